"""`manage.py make_matrix`: write a seeded random matrix file and its epoch metadata sidecar."""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from gpu_engine.matrix import PAGE_BYTES, metadata_path, write_epoch_metadata, write_matrix_file
from morpho_pir.protocol import HexError, parse_hex


def _state_root(text: str) -> bytes:
    try:
        raw = parse_hex(text)
    except HexError:
        raise CommandError(f"--state-root: expected 64 hex digits, got {text!r}") from None
    if len(raw) != 32:
        raise CommandError(f"--state-root: expected 32 bytes, got {len(raw)}")
    return raw


class Command(BaseCommand):
    help = "Write a seeded random page matrix (4096-byte pages) and its <out>.epoch.json."

    def add_arguments(self, parser):
        parser.add_argument("--pages", type=int, required=True, help="number of 4096-byte pages")
        parser.add_argument("--seed", type=int, default=0,
                            help="generator seed (same seed, same pages)")
        parser.add_argument("--out", required=True, help="matrix file to write")
        parser.add_argument("--epoch-id", type=int, default=1, help="epoch_id to serve it under")
        parser.add_argument("--block-number", type=int, default=0, help="block_number of the epoch")
        parser.add_argument("--state-root", default="00" * 32, help="32-byte state root, hex")
        parser.add_argument(
            "--cuckoo-seeds", type=int, nargs=3, default=(0, 0, 0), metavar="U64",
            help="the three cuckoo hash seeds",
        )

    def handle(self, *args, pages, seed, out, epoch_id, block_number, state_root, cuckoo_seeds,
               **options):
        if pages < 1:
            raise CommandError(f"--pages: expected at least 1, got {pages}")
        if epoch_id < 0 or block_number < 0:
            raise CommandError("--epoch-id and --block-number must be >= 0")
        if any(not 0 <= s < 1 << 64 for s in cuckoo_seeds):
            raise CommandError(f"--cuckoo-seeds: expected three u64 values, got {cuckoo_seeds}")
        root = _state_root(state_root)
        last_tenth = [-1]

        def progress(done: int, total: int) -> None:
            tenth = done * 10 // total
            if tenth != last_tenth[0] and options.get("verbosity", 1) > 1:
                last_tenth[0] = tenth
                self.stdout.write(f"  {done}/{total} pages")

        path = write_matrix_file(out, pages, seed, progress=progress)
        write_epoch_metadata(
            path, epoch_id=epoch_id, block_number=block_number, state_root=root,
            seeds=tuple(cuckoo_seeds),
        )
        self.stdout.write(
            f"wrote {path} ({pages} pages, {pages * PAGE_BYTES} bytes, seed {seed}) "
            f"and {metadata_path(path)} (epoch {epoch_id}, block {block_number})"
        )

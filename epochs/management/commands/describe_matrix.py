"""`manage.py describe_matrix PATH`: write the sidecar that lets a matrix file be an epoch's."""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from gpu_engine.matrix import PAGE_BYTES, read_epoch_metadata, write_epoch_metadata
from morpho_pir.protocol import parse_hex


class Command(BaseCommand):
    help = ("Read a matrix file (raw 4096-byte pages) and write <PATH>.epoch.json with its page "
            "count, size and SHA-256, which an epoch record requires; the epoch fields of a "
            "sidecar already there are kept.")

    def add_arguments(self, parser):
        parser.add_argument("path", help="the matrix file")

    def handle(self, *args, path, **options):
        try:
            meta = read_epoch_metadata(path)
            out = write_epoch_metadata(
                path, epoch_id=int(meta.get("epoch_id", 1)),
                block_number=int(meta.get("block_number", 0)),
                state_root=parse_hex(meta.get("state_root", "00" * 32), 32),
                seeds=tuple(int(s) for s in meta.get("seeds", (0, 0, 0))))
        except (OSError, ValueError, TypeError) as exc:
            raise CommandError(f"{path}: {exc}") from None
        written = read_epoch_metadata(path)
        self.stdout.write(f"wrote {out}: {written['num_pages']} pages of {PAGE_BYTES} bytes, "
                          f"{written['size_bytes']} bytes, sha256 {written['sha256']}")

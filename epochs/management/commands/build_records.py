"""`manage.py build_records --input FILE --out MATRIX`: key -> value records as a records epoch."""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from epochs.records_input import FORMATS, RecordsInputError, read_records
from gpu_engine.matrix import metadata_path, write_epoch_metadata
from gpu_engine.records import DEFAULT_LOAD, build
from morpho_pir.protocol import parse_hex
from morpho_pir.records import RecordsError


class Command(BaseCommand):
    help = ("Place key -> value records (CSV or JSON Lines, hex keys and values) in cuckoo pages "
            "(docs/PROTOCOL.md section 9) and write the matrix file and its <out>.epoch.json, "
            "which carries the table's parameters; load it with load_epoch.")

    def add_arguments(self, parser):
        parser.add_argument("--input", required=True, help="records file (.csv, .jsonl)")
        parser.add_argument("--out", required=True, help="matrix file to write")
        parser.add_argument("--format", choices=FORMATS, help="default: from the input's suffix")
        parser.add_argument("--key-column", default="key", help="column of the keys (hex)")
        parser.add_argument("--value-column", default="value", help="column of the values (hex)")
        parser.add_argument("--type-column", help="column of the type bytes (1..255); default: "
                                                  "every record has type 1")
        parser.add_argument("--key-bytes", type=int, help="default: the first key's length")
        parser.add_argument("--value-bytes", type=int, help="default: the first value's length")
        parser.add_argument("--seed", type=int,
                            help="the table's first hash seed (u64); default: a random one")
        parser.add_argument("--load", type=float, default=DEFAULT_LOAD,
                            help=f"records per row to aim at (default {DEFAULT_LOAD}); the page "
                                 f"count follows, and grows only if placement fails")
        parser.add_argument("--pages", type=int, help="the page count to start from (instead of "
                                                      "--load)")
        parser.add_argument("--workers", type=int, help="processes that hash (default: the CPUs)")
        parser.add_argument("--epoch-id", type=int, default=1)
        parser.add_argument("--block-number", type=int, default=0)
        parser.add_argument("--state-root", default="00" * 32, help="32 bytes as hex")

    def handle(self, *args, **options):
        load = options["load"]
        if not 0 < load <= 1:
            raise CommandError(f"--load: expected a fraction in (0, 1], got {load}")
        seed = options["seed"]
        if seed is None:
            seed = secrets.randbits(64)
        if not 0 <= seed < 1 << 64:
            raise CommandError(f"--seed: expected a u64, got {seed}")
        try:
            root = parse_hex(options["state_root"], 32)
        except ValueError as exc:
            raise CommandError(f"--state-root: {exc}") from None
        started = time.perf_counter()
        try:
            keys, values, types = read_records(
                options["input"], options["format"], options["key_column"],
                options["value_column"], options["type_column"], options["key_bytes"],
                options["value_bytes"])
        except (OSError, RecordsInputError) as exc:
            raise CommandError(f"--input: {exc}") from None
        read_s = time.perf_counter() - started
        try:
            built = build(keys, values, types, seed, load=load, num_pages=options["pages"],
                          workers=options["workers"])
        except RecordsError as exc:
            raise CommandError(str(exc)) from None
        build_s = time.perf_counter() - started - read_s
        out = Path(options["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        built.rows.tofile(part)
        os.replace(part, out)  # never a half-written matrix under the real name
        write_epoch_metadata(out, epoch_id=options["epoch_id"],
                             block_number=options["block_number"], state_root=root,
                             records=built.table)
        table = built.table
        self.stdout.write(
            f"wrote {out} ({table.num_pages} pages, {keys.shape[0]} records, load "
            f"{built.load:.4f}, seed {table.seed} after {built.seeds_tried} seed(s), key "
            f"{table.key_bytes} bytes, value {table.value_bytes} bytes, fingerprint "
            f"{table.fingerprint_hex}) and {metadata_path(out)} (epoch {options['epoch_id']}) "
            f"in {time.perf_counter() - started:.1f} s (read {read_s:.1f} s, build "
            f"{build_s:.1f} s)")

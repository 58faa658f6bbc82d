"""Time a records table build (gpu_engine.records.build) at account-like records; write a CSV.

Random 20-byte keys with 72-byte values (an Ethereum account: balance, nonce, code hash), the
table built at the default load, every record then checked to be in exactly one row of its
candidate pages (a sample of them read back through RecordsTable.find).

    python benchmarks/records_build.py --records 1000000 --out docs/benchmarks/records_build_cpu.csv
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent),
                str(Path(__file__).resolve().parent.parent / "pir")]

from gpu_engine.records import DEFAULT_LOAD, build  # noqa: E402
from morpho_pir.protocol import ROWS_PER_PAGE  # noqa: E402


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD)
    parser.add_argument("--workers", type=int, help="hashing processes (default: the CPUs)")
    parser.add_argument("--check", type=int, default=2000, help="records read back per build")
    parser.add_argument("--machine", default="", help="words for the CSV's machine line")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    lines = []
    for count in args.records:
        rng = np.random.default_rng(count)
        keys = rng.integers(0, 256, (count, 20), dtype=np.uint8)
        values = rng.integers(0, 256, (count, 72), dtype=np.uint8)
        types = np.ones(count, dtype=np.uint8)
        started = time.perf_counter()
        built = build(keys, values, types, seed=count, load=args.load, workers=args.workers)
        seconds = time.perf_counter() - started
        table = built.table
        assert np.count_nonzero(built.rows[:, 0]) == count, "a record is missing"
        for index in rng.choice(count, min(count, args.check), replace=False).tolist():
            key = keys[index].tobytes()
            pages = [built.rows[p * ROWS_PER_PAGE:(p + 1) * ROWS_PER_PAGE].tobytes()
                     for p in table.candidate_pages(key)]
            assert table.find(key, pages).value == values[index].tobytes()
        line = (f"{count},{table.num_pages},{built.load:.4f},{built.seeds_tried},{seconds:.2f},"
                f"{count / seconds:.0f}")
        print(line, flush=True)
        lines.append(line)
        del built, keys, values
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = [
        f"# machine: {args.machine or platform.node()}; {cpu_name()}; {os.cpu_count()} CPUs; "
        f"load average {load} at the end",
        f"# shape: 20-byte keys, 72-byte values, type 1; load target {args.load}; hashing "
        f"processes {args.workers or os.cpu_count()}",
        f"# command: python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}",
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        "# seconds: hashing, placement (vectorised rounds, then eviction walks) and the rows; "
        "not the file write. load: records per row",
        "records,pages,load,seeds_tried,seconds,records_per_s",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(header + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

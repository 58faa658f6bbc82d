"""Runs a few batches of one shape on the CUDA backend, for a profiler (ncu) to watch.

    ncu --clock-control none -k regex:dpf_scan --launch-skip 1 --launch-count 1 \
        python3 benchmarks/profile_scan.py --pages 1048593 --domain-bits 25 --keys 96

The first batch warms up (compiles, allocates); the profiler is meant to skip it. Needs CuPy.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.variant import add_define_argument, apply_defines  # noqa: E402
from gpu_engine.backends import DispatchShape, create_backend  # noqa: E402
from gpu_engine.backends.cuda_plan import MATRIX_LAYOUTS, V2_SCANS, describe_plan  # noqa: E402
from morpho_pir.dpf import KeyBatch, format_by_name, gen_keys  # noqa: E402
from gpu_engine.matrix import domain_bits_for  # noqa: E402
from morpho_pir.protocol import KEY_FORMAT_NAMES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--domain-bits", type=int, default=None)
    ap.add_argument("--keys", type=int, default=96)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--max-group-keys", type=int, default=None)
    ap.add_argument("--chunk-levels", type=int, default=None)
    ap.add_argument("--key-format", choices=KEY_FORMAT_NAMES, default="v1")
    ap.add_argument("--v2-scan", choices=V2_SCANS, default=None)
    ap.add_argument("--layout", choices=MATRIX_LAYOUTS, default="pages")
    add_define_argument(ap)
    args = ap.parse_args()
    apply_defines(args)

    d = domain_bits_for(args.pages, args.domain_bits)
    resident = create_backend("cuda", layout=args.layout).generate(args.pages, seed=5, domain_bits=d)
    if args.max_group_keys:
        resident.max_group_keys = args.max_group_keys
    if args.chunk_levels:
        resident.chunk_levels = args.chunk_levels
    if args.v2_scan:
        resident.v2_scan = args.v2_scan
    fmt = format_by_name(args.key_format)
    rng = np.random.default_rng(5)
    keys = KeyBatch.from_keys([gen_keys(int(rng.integers(args.pages)), d, rng, key_format=fmt)[0]
                               for _ in range(args.keys)])
    plan = resident.plan(args.keys, fmt)
    print(describe_plan(plan), flush=True)
    for i in range(args.batches):
        t0 = time.perf_counter()
        resident.answer(keys, DispatchShape())
        print(f"batch {i}: {(time.perf_counter() - t0) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()

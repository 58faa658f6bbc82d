"""Kernel variants (-D sets) of the scans timed in one process, over one matrix generated once.

Each variant's kernels are rebuilt (NVRTC, about 15 s on the device) and timed per kernel (CUDA events,
graphs off, the scan's and the batch's GPU time) and end to end; every variant's answers must equal
the first's byte for byte. A device call's seconds go to the variants, not to a matrix each
(`pairs=0` in a variant: v1 keys one block a key group, dpf_scan_v1_frag, instead of pairs of groups):

    python3 benchmarks/variant_times.py --out v.csv --q 1,2 default V1F_XOR_PREFETCH=1 V1F_XOR_PREFETCH=3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kernel_times import time_kernels  # noqa: E402
from gpu_engine.backends import DispatchShape, create_backend  # noqa: E402
from gpu_engine.backends.cuda_plan import MATRIX_LAYOUTS  # noqa: E402
from morpho_pir.dpf import KeyBatch, format_by_name, gen_keys  # noqa: E402
from gpu_engine.matrix import domain_bits_for  # noqa: E402
from morpho_pir.protocol import KEY_FORMAT_NAMES, KEYS_PER_QUERY  # noqa: E402

COLUMNS = "variant,q,scan_ms_median,scan_ms_min,gpu_ms_median,wall_ms_median,qps_wall,same_answers"


def csv_row(variant: str, q: int, scans: list, gpus: list, walls: list, same: bool) -> str:
    """One row of COLUMNS from a variant's timed batches (ms), the variant one field whatever its options."""
    name = f'"{variant}"' if "," in variant else variant
    wall = statistics.median(walls)
    return (f"{name},{q},{statistics.median(scans):.3f},{min(scans):.3f},"
            f"{statistics.median(gpus):.3f},{wall:.3f},{1e3 * q / wall:.1f},{same}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--pages", type=int, default=16817159)
    ap.add_argument("--domain-bits", type=int, default=None)
    ap.add_argument("--layout", choices=MATRIX_LAYOUTS, default="fragments")
    ap.add_argument("--key-format", choices=KEY_FORMAT_NAMES, default="v1", help="docs/PROTOCOL.md 3, 3.1")
    ap.add_argument("--q", default="1,2", help="comma-separated query counts (3 keys each)")
    ap.add_argument("--reps", type=int, default=6, help="batches per query count and variant (the first not counted)")
    ap.add_argument("variants", nargs="+",
                    help="a variant each: comma-separated NAME=VALUE -D options (pairs=0: v1 keys one block a "
                         "key group, never dpf_scan_v1_pair), or 'default' for the build as it is")
    args = ap.parse_args(argv)

    import cupy

    from gpu_engine.backends import cuda_module

    events: list = []
    time_kernels(events)
    d = domain_bits_for(args.pages, args.domain_bits)
    t0 = time.perf_counter()
    resident = create_backend("cuda", layout=args.layout).generate(args.pages, seed=5, domain_bits=d)
    print(f"matrix: {args.pages} pages, d={d}, {args.layout}, {time.perf_counter() - t0:.1f} s", flush=True)
    fmt = format_by_name(args.key_format)
    rng = np.random.default_rng(5)
    batches = {q: KeyBatch.from_keys([gen_keys(int(rng.integers(args.pages)), d, rng, key_format=fmt)[0]
                                      for _ in range(KEYS_PER_QUERY * q)])
               for q in (int(x) for x in args.q.split(","))}
    pairs = resident._backend.v1_pairs
    first: dict = {}  # the first variant's answers: every other variant's must equal them byte for byte
    with open(args.out, "w") as out:
        out.write(f"# gpu: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}\n")
        out.write(f"# shape: pages={args.pages}, domain_bits={d}, layout={args.layout}, keys={args.key_format}\n")
        out.write(f"# command: python3 {' '.join(sys.argv)}\n")
        out.write(f"# date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
        out.write(COLUMNS + "\n")
        for variant in args.variants:
            options = [] if variant == "default" else variant.split(",")
            # pairs=0: the backend's v1_pairs off (v1 keys: dpf_scan_v1_frag whatever the groups)
            resident._backend.v1_pairs = pairs and "pairs=0" not in options
            defines = [o for o in options if o != "pairs=0"]
            cuda_module._VARIANT_DEFINES = ()  # each variant from the build as it is
            cuda_module.add_defines(defines)
            cuda_module._module.cache_clear()
            resident._states.clear()  # launch shapes hold the kernels of the variant before
            for q, keys in batches.items():
                scans, gpus, walls = [], [], []
                for _ in range(args.reps):
                    events.clear()
                    t1 = time.perf_counter()
                    answers = resident.answer(keys, DispatchShape())
                    walls.append((time.perf_counter() - t1) * 1e3)
                    scans.append(sum(cupy.cuda.get_elapsed_time(a, b) for name, a, b in events if name == "scan"))
                    gpus.append(cupy.cuda.get_elapsed_time(events[0][1], events[-1][2]))
                same = np.array_equal(first.setdefault(q, answers), answers)
                row = csv_row(variant, q, scans[1:], gpus[1:], walls[1:], same)
                print(row, flush=True)
                out.write(row + "\n")
                if not same:
                    print(f"CHECK FAILED: {variant} q={q} answers differ from {args.variants[0]}'s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Times CUDA scan variants (keys per block, chunk size, dispatch shape) over one resident matrix.

    python -m gpu_engine.bench.cuda_variants --pages 16817159 --domain-bits 25 --q 1,8,32 \
        --variants g16-c7-mb0-s1-g0,g32-c7-mb0-s1-g0 --out variants.csv

A variant is g<max keys per block>-c<chunk levels>-mb<micro batch>-s<streams>-g<graph 0/1>.
Each figure is the median of --repeat batch calls, end to end (keys in, answers out); every
batch is checked by XOR of the two parties' answers against the target pages.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from typing import Callable, List, Sequence

import numpy as np

from gpu_engine.backends import DispatchShape
from gpu_engine.bench.pir_bench import make_queries
from gpu_engine.dpf import KeyBatch
from gpu_engine.matrix import domain_bits_for

_VARIANT = re.compile(r"^g(\d+)-c(\d+)-mb(\d+)-s(\d+)-g([01])$")


def parse_variant(text: str):
    m = _VARIANT.match(text)
    if not m:
        raise ValueError(f"variant {text!r} is not g<keys>-c<levels>-mb<n>-s<n>-g<0|1>")
    g, c, mb, s, graph = (int(x) for x in m.groups())
    return g, c, DispatchShape(micro_batch=mb, streams=s, graph=bool(graph))


def time_variant(resident, page_of: Callable[[int], bytes], queries, variant: str, repeat: int) -> dict:
    g, c, dispatch = parse_variant(variant)
    resident.max_group_keys, resident.chunk_levels = g, c
    batch0 = KeyBatch.from_keys(queries.party0)
    batch1 = KeyBatch.from_keys(queries.party1)
    a0 = resident.answer(batch0, dispatch)  # warm-up: compile, buffers, graph capture
    a1 = resident.answer(batch1, dispatch)
    ok = all((a0[i] ^ a1[i]).tobytes() == page_of(t) for i, t in enumerate(queries.targets))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        resident.answer(batch0, dispatch)
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    q = len(queries.targets) // 3
    return {"variant": variant, "q": q, "batch_ms": round(ms, 4), "batch_qps": round(q / ms * 1e3, 2),
            "spread_ms": round(max(times) - min(times), 4), "ok": ok}


def main(argv: Sequence[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--domain-bits", type=int, default=None)
    ap.add_argument("--q", default="1,8,32")
    ap.add_argument("--variants", required=True, help="comma-separated variant names")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--kernel-define", action="append", default=[],
                    help="NAME=VALUE passed to NVRTC for this run only (kernel experiments)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.kernel_define:
        from gpu_engine.backends import cuda_module

        cuda_module.NVRTC_OPTIONS = cuda_module.NVRTC_OPTIONS + tuple(f"-D{d}" for d in args.kernel_define)

    from gpu_engine.backends.cuda import CudaBackend

    d = domain_bits_for(args.pages, args.domain_bits)
    backend = CudaBackend()
    t0 = time.perf_counter()
    resident = backend.generate(args.pages, args.seed, d)
    print(f"generated {args.pages} pages d={d} in {time.perf_counter() - t0:.1f} s on {backend.device_name}", flush=True)
    rng = np.random.default_rng(args.seed)
    rows: List[dict] = []
    for q in (int(x) for x in args.q.split(",")):
        queries = make_queries(q, args.pages, d, rng)
        for variant in args.variants.split(","):
            row = time_variant(resident, resident.read_page, queries, variant, args.repeat)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            rows.append(row)
    with open(args.out, "w") as fh:
        fh.write(f"# gpu: {backend.device_name}\n# shape: pages={args.pages}, domain_bits={d}\n")
        fh.write("# command: " + " ".join(sys.argv) + "\n")
        fh.write(f"# kernel defines: {' '.join(args.kernel_define) or 'none'}\n")
        fh.write("variant, q, batch_ms, batch_qps, spread_ms, ok\n")
        for r in rows:
            fh.write(f"{r['variant']}, {r['q']}, {r['batch_ms']}, {r['batch_qps']}, {r['spread_ms']}, {r['ok']}\n")
    resident.release()
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

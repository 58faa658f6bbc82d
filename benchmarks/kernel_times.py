"""Each CUDA kernel's share of one batch: the tree's top levels, the leaf bits and the scan.

    python3 benchmarks/kernel_times.py --pages 16817159 --domain-bits 25 --layout fragments --q 32,74

Generates the matrix on the GPU, then runs each batch size `--batches` times (the first compiles
and allocates) and prints, per batch, its wall time, the GPU time from its first kernel's start to
its last kernel's end, and each kernel's time summed over its launches, from CUDA events recorded
around every launch (so graphs are off: one kernel at a time). docs/SCANS.md quotes its
figures. 3 keys a query, v2 unless --key-format says otherwise; --define builds the
kernels with a variant's -D option. Needs CuPy.
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
from gpu_engine.backends.cuda_plan import MATRIX_LAYOUTS, describe_plan  # noqa: E402
from morpho_pir.dpf import KeyBatch, format_by_name, gen_keys  # noqa: E402
from gpu_engine.matrix import domain_bits_for  # noqa: E402
from morpho_pir.protocol import KEY_FORMAT_NAMES, KEYS_PER_QUERY  # noqa: E402


class TimedKernel:
    """A kernel whose every launch is bracketed by two CUDA events on the current stream."""

    def __init__(self, name: str, kernel, events: list) -> None:
        self.name, self.kernel, self.events = name, kernel, events

    def __call__(self, *args, **kwargs):
        import cupy

        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        result = self.kernel(*args, **kwargs)
        stop.record()
        self.events.append((self.name, start, stop))
        return result


def time_kernels(events: list) -> None:
    """Wrap the kernels of every micro-batch the CUDA backend builds from now on."""
    from gpu_engine.backends import cuda

    build = cuda._MicroBatch.__init__

    def timed_init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        for attr, name in (("top", "top"), ("leaf_bits", "leaf_bits"), ("scan", "scan")):
            if getattr(self, attr) is not None:
                setattr(self, attr, TimedKernel(name, getattr(self, attr), events))

    cuda._MicroBatch.__init__ = timed_init


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--domain-bits", type=int, default=None)
    ap.add_argument("--layout", choices=MATRIX_LAYOUTS, default="fragments")
    ap.add_argument("--q", default="32,74", help="comma-separated query counts (3 keys each)")
    ap.add_argument("--batches", type=int, default=4, help="batches per query count")
    ap.add_argument("--key-format", choices=KEY_FORMAT_NAMES, default="v2", help="docs/PROTOCOL.md 3, 3.1")
    add_define_argument(ap)
    args = ap.parse_args(argv)

    import cupy

    apply_defines(args)

    d = domain_bits_for(args.pages, args.domain_bits)
    events: list = []
    time_kernels(events)
    t0 = time.perf_counter()
    resident = create_backend("cuda", layout=args.layout).generate(args.pages, seed=5, domain_bits=d)
    print(f"matrix: {args.pages} pages, d={d}, {args.layout}, {time.perf_counter() - t0:.1f} s", flush=True)
    fmt = format_by_name(args.key_format)
    rng = np.random.default_rng(5)
    for q in (int(x) for x in args.q.split(",")):
        keys = KeyBatch.from_keys([gen_keys(int(rng.integers(args.pages)), d, rng, key_format=fmt)[0]
                                   for _ in range(KEYS_PER_QUERY * q)])
        print(f"Q={q}: {describe_plan(resident.plan(len(keys), fmt))}", flush=True)
        for batch in range(args.batches):
            events.clear()
            t0 = time.perf_counter()
            resident.answer(keys, DispatchShape())
            wall = (time.perf_counter() - t0) * 1e3
            kernels: dict = {}
            for name, start, stop in events:
                kernels[name] = kernels.get(name, 0.0) + cupy.cuda.get_elapsed_time(start, stop)
            gpu = cupy.cuda.get_elapsed_time(events[0][1], events[-1][2])
            print(f"Q={q} batch {batch}: wall {wall:.2f} ms, gpu {gpu:.2f} ms, "
                  + ", ".join(f"{name} {ms:.3f} ms" for name, ms in kernels.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

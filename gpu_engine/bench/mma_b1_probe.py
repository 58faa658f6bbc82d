"""Measures 1-bit tensor-core (AND+POPC) throughput and what it would make of the page scan.

    python -m gpu_engine.bench.mma_b1_probe

Evidence for docs/benchmarks/NOTES-cuda.md: the scan's XOR-of-ANDs is a binary matrix product
over pages, so its ceiling on tensor cores is this rate; compared with the LOP3 path's 32 bits
per lane instruction on the ALU pipe.
"""
from __future__ import annotations

import numpy as np

MAINNET_PAGES = 16_817_159
BITS_PER_MMA = 16 * 8 * 256  # m16n8k256: AND+POPC products per warp instruction
BITS_PER_PAGE = 4096 * 8


def main() -> None:
    import cupy

    from gpu_engine.backends.cuda_module import get_kernel

    kernel = get_kernel("mma_b1_probe.cu", "mma_b1_probe")
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    sms = props["multiProcessorCount"]
    out = cupy.empty(sms * 8 * 256, dtype=np.int32)
    chains = 8
    for blocks_per_sm in (1, 2, 4, 8):
        grid, iters = sms * blocks_per_sm, 4096
        kernel((grid,), (256,), (np.uint32(1), np.int32(16), out))  # warm-up
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        kernel((grid,), (256,), (np.uint32(1), np.int32(iters), out))
        stop.record()
        stop.synchronize()
        seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3
        mmas = grid * 8 * iters * chains  # 8 warps a block
        rate = mmas * BITS_PER_MMA / seconds
        per_key_ms = MAINNET_PAGES * BITS_PER_PAGE / rate * 1e3
        print(f"{blocks_per_sm} blocks/SM: {mmas / seconds / 1e9:.1f} G mma/s = {rate / 1e12:.0f} T AND-POPC/s; "
              f"mainnet scan {per_key_ms:.3f} ms per key ({96 * per_key_ms:.1f} ms for 96 keys)", flush=True)


if __name__ == "__main__":
    main()

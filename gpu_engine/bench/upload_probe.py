"""Times CudaBackend.load from a loaded matrix (the per-epoch upload, from host memory).

    python -m gpu_engine.bench.upload_probe --pages 1048576 --dir /tmp
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from gpu_engine.matrix import load_matrix, write_matrix_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=1 << 20)
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()

    from gpu_engine.backends.cuda import CudaBackend

    path = Path(args.dir) / f"upload-probe-{args.pages}.bin"
    t0 = time.perf_counter()
    write_matrix_file(path, args.pages, seed=3)
    print(f"wrote {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    backend = CudaBackend()
    matrix = load_matrix(path)
    calls = []
    t0 = time.perf_counter()
    resident = backend.load(matrix, progress=lambda done, total: calls.append(done))
    seconds = time.perf_counter() - t0
    print(f"uploaded {matrix.nbytes / 1e9:.2f} GB in {seconds:.2f} s = {matrix.nbytes / seconds / 1e9:.2f} GB/s "
          f"(page cache warm from the write; {len(calls)} progress calls); {backend.memory_info()}", flush=True)
    assert resident.read_page(args.pages - 1) == matrix.page(args.pages - 1)
    resident.release()
    os.unlink(path)


if __name__ == "__main__":
    main()

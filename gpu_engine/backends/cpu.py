"""The NumPy backend: the reference answers, one pass over the matrix per batch."""
from __future__ import annotations

import os
import platform
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Optional

import numpy as np

from gpu_engine.backends.base import Backend, DispatchShape, ProgressFn, ResidentMatrix
from morpho_pir.dpf import KeyBatch, iter_page_masks
from gpu_engine.matrix import PAGE_BYTES, WORDS_PER_PAGE, PageMatrix

SCAN_PAGES = 64  # pages per scan block: 256 KiB of matrix + 256 KiB scratch stay in L2
MASK_BUDGET_WORDS = 1 << 21  # masks held per worker at once (K x leaves x 4 words, 8 MiB of masks)


def default_workers() -> int:
    """Scan threads: the CPUs this process may use (NumPy ufuncs release the GIL)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def mask_chunk_bits(num_keys: int, domain_bits: int, workers: int) -> int:
    """log2 of the leaves whose masks one worker expands at once: within the mask budget,
    and small enough that every worker gets at least one chunk."""
    budget = max(1, MASK_BUDGET_WORDS // (4 * num_keys)).bit_length() - 1
    split = max(0, domain_bits - (workers - 1).bit_length())
    return max(0, min(budget, split, domain_bits))


def _scan_part(matrix: PageMatrix, keys: KeyBatch, chunk_bits: int, part: int, parts: int) -> np.ndarray:
    """XOR of (page AND mask) over this worker's share of the pages, for every key."""
    k = len(keys)
    acc = np.zeros((k, WORDS_PER_PAGE // 4, 4), dtype=np.uint32)
    scratch = np.empty((SCAN_PAGES, WORDS_PER_PAGE // 4, 4), dtype=np.uint32)
    for first, masks in iter_page_masks(keys, matrix.num_pages, chunk_bits, part, parts):
        for off in range(0, masks.shape[1], SCAN_PAGES):
            n = min(SCAN_PAGES, masks.shape[1] - off)
            block = matrix.block(first + off, first + off + n).reshape(n, WORDS_PER_PAGE // 4, 4)
            tmp = scratch[:n]
            for key in range(k):
                # the 16-byte mask covers every 16-byte group of the page
                np.bitwise_and(block, masks[key, off : off + n, None, :], out=tmp)
                acc[key] ^= np.bitwise_xor.reduce(tmp, axis=0)
    return acc


class NumpyResident(ResidentMatrix):
    """A matrix held in host memory (copy-on-write, so row writes never touch the file)."""

    def __init__(self, matrix: PageMatrix, workers: int) -> None:
        super().__init__(matrix)
        self.matrix = matrix
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="numpy-scan") if workers > 1 else None

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def answer(self, keys: KeyBatch, dispatch: DispatchShape = DispatchShape()) -> np.ndarray:
        self.check_keys(keys)
        parts = max(1, min(self.workers, self.num_pages))
        bits = mask_chunk_bits(len(keys), self.domain_bits, parts)
        if self._pool is None or parts == 1:
            acc = _scan_part(self.matrix, keys, bits, 0, 1)
        else:
            futures = [self._pool.submit(_scan_part, self.matrix, keys, bits, p, parts) for p in range(parts)]
            acc = futures[0].result()
            for fut in futures[1:]:
                acc ^= fut.result()
        return acc.reshape(len(keys), WORDS_PER_PAGE).astype("<u4").view(np.uint8).reshape(len(keys), PAGE_BYTES)

    def write_rows(self, rows: Mapping[int, bytes]) -> None:
        self.matrix.check_rows(rows)
        for index, data in rows.items():
            self.matrix.write_row(index, data)

    def release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class NumpyBackend(Backend):
    """The CPU backend; also the reference every other backend is tested against."""

    name = "cpu"

    def __init__(self, workers: Optional[int] = None) -> None:
        super().__init__()
        self.workers = workers or default_workers()

    def load(self, matrix: PageMatrix, progress: Optional[ProgressFn] = None) -> NumpyResident:
        if progress:
            progress(matrix.nbytes, matrix.nbytes)  # nothing to upload: pages are read in place
        return NumpyResident(matrix, self.workers)

    def memory_info(self) -> dict:
        return {"device": f"cpu ({platform.processor() or platform.machine()}, {self.workers} scan threads)",
                "used_bytes": None, "total_bytes": None}


def reference_answers(matrix: PageMatrix, keys: KeyBatch) -> np.ndarray:
    """Answers by the plain NumPy path, single-threaded: (K, 4096) u8."""
    resident = NumpyResident(matrix, workers=1)
    return resident.answer(keys)

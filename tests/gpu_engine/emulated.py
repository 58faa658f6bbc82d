"""What the emulated kernels' tests share: key batches, the NumPy backend's answers, matrices."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.backends.cpu import NumpyBackend
from gpu_engine.matrix import random_matrix
from morpho_pir.dpf import KEY_FORMAT_V1, KeyBatch, gen_keys
from tests import cuda_emulator

# every test of the kernels' text: skipped with the reason where no C++ compiler builds it
KERNELS = [pytest.mark.kernels,
           pytest.mark.skipif(cuda_emulator.compiler() is None,
                              reason=f"no C++ compiler {cuda_emulator.CXX!r} to build the emulated kernels")]


def key_batch(num_keys: int, num_pages: int, domain_bits: int, seed: int, key_format: int = KEY_FORMAT_V1) -> KeyBatch:
    rng = np.random.default_rng(seed)
    return KeyBatch.from_keys([gen_keys(int(rng.integers(num_pages)), domain_bits, rng, key_format=key_format)[i % 2]
                               for i in range(num_keys)])


def numpy_answers(matrix, batch) -> np.ndarray:
    return np.asarray(NumpyBackend(workers=2).load(matrix).answer(batch)).view(np.uint32).reshape(
        len(batch.root_seed), -1)


@pytest.fixture(scope="module")
def matrices():
    """num_pages -> (a random matrix, its fragments layout), made once a module."""
    cache = {}

    def get(num_pages: int):
        if num_pages not in cache:
            matrix = random_matrix(num_pages, seed=num_pages)
            pages = np.ascontiguousarray(matrix.block(0, num_pages))
            cache[num_pages] = matrix, cuda_emulator.to_fragments(pages)
        return cache[num_pages]

    return get

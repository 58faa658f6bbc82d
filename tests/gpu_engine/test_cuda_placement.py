"""Placement over CUDA devices: sharded and replicated epochs answer byte for byte as the
NumPy backend does, for both key formats, with shard boundaries mid-subtree and page counts that
are not powers of two. On one GPU the two "devices" are two backends of the same GPU; on two or
more GPUs, one backend each."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, KeyBatch, gen_keys
from gpu_engine.matrix import random_matrix
from gpu_engine.placement import DeviceGroup, Placement

pytestmark = pytest.mark.gpu


def cuda_group() -> DeviceGroup:
    """Two devices: GPUs 0 and 1 where there are two, else GPU 0 twice."""
    import cupy

    from gpu_engine.backends.cuda import CudaBackend

    ids = [0, 1] if cupy.cuda.runtime.getDeviceCount() >= 2 else [0, 0]
    return DeviceGroup([CudaBackend(i) for i in ids], [f"cuda:{i}" for i in ids])


def both_parties(targets, domain_bits, key_format):
    rng = np.random.default_rng(len(targets) + key_format)
    pairs = [gen_keys(int(t), domain_bits, rng, key_format=key_format) for t in targets]
    return KeyBatch.from_keys([p[0] for p in pairs]), KeyBatch.from_keys([p[1] for p in pairs])


@pytest.mark.parametrize("key_format", [KEY_FORMAT_V1, KEY_FORMAT_V2])
@pytest.mark.parametrize("num_pages, bounds", [
    (1000, [0, 384, 1000]),  # 384 inside the subtree [256, 512)
    (70001, None),  # balanced default, the last device's range past 65536 pages
    (65536, [0, 32768, 65536]),
])
@pytest.mark.parametrize("placement", [Placement.SHARD, Placement.REPLICATE])
def test_cuda_placements_answer_as_numpy(key_format, num_pages, bounds, placement):
    matrix = random_matrix(num_pages, seed=num_pages)
    resident = cuda_group().load(matrix, placement=placement,
                                 bounds=bounds if placement is Placement.SHARD else None)
    try:
        edges = getattr(resident, "bounds", [0, num_pages])
        targets = sorted({0, num_pages - 1, *edges[1:-1], *(b - 1 for b in edges[1:-1]), 12345 % num_pages})
        for keys in both_parties(targets, matrix.domain_bits, key_format):
            expected = reference_answers(matrix, keys)
            assert expected.any()
            for _ in range(2):  # replicate: the second batch on the other device
                assert np.array_equal(resident.answer(keys), expected)
        # many batches in flight at once, as the engine keeps them
        party0, _ = both_parties(targets, matrix.domain_bits, key_format)
        started = [resident.start(party0) for _ in range(resident.max_in_flight)]
        expected = reference_answers(matrix, party0)
        assert all(np.array_equal(p.result(), expected) for p in started)
        rows = {384 * 16: b"\x5a" * 256, num_pages * 16 - 1: b"\xa5" * 256}
        resident.write_rows(rows)
        for row, data in rows.items():
            matrix.write_row(row, data)
        assert np.array_equal(resident.answer(party0), reference_answers(matrix, party0))
    finally:
        resident.release()

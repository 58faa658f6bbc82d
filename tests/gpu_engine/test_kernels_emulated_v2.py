"""The ALU scans of both key formats over the pages layout, and v2 keys on the (emulated) tensor
cores over either layout (mma.sync; the wgmma scan is sm_90a assembly and is not emulated), the
CUDA kernels' own text run on the CPU against the NumPy backend."""
from __future__ import annotations

import numpy as np
import pytest

from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2
from tests import cuda_emulator
from tests.gpu_engine.emulated import KERNELS, key_batch, matrices, numpy_answers  # noqa: F401 (a fixture)

pytestmark = KERNELS


@pytest.mark.parametrize("key_format", [KEY_FORMAT_V1, KEY_FORMAT_V2])
@pytest.mark.parametrize("num_pages, num_keys, resident_blocks", [
    (1, 1, 264),       # the chunk (v2: the leaf) is the whole tree
    (600, 3, 264),     # groups of 3
    (4097, 7, 264),    # groups of 7 under a top stage (v1: 5 levels, v2: 6, to the leaves)
    (4097, 17, 1),     # two groups of 9, the last padded with a copy of key 17; several chunks a block
])
def test_both_key_formats_over_the_pages_layout_match_numpy(matrices, key_format, num_pages, num_keys,
                                                            resident_blocks):
    matrix, _ = matrices(num_pages)
    batch = key_batch(num_keys, num_pages, matrix.domain_bits, seed=num_pages * num_keys, key_format=key_format)
    expected = numpy_answers(matrix, batch)
    assert expected.any(axis=1).all()
    assert (cuda_emulator.alu_plan(num_pages, batch, resident_blocks).chunks_per_block > 1) == (resident_blocks == 1)
    got = cuda_emulator.alu_answers(np.ascontiguousarray(matrix.block(0, num_pages)), batch, resident_blocks)
    assert [np.array_equal(g, e) for g, e in zip(got, expected)] == [True] * num_keys


@pytest.mark.parametrize("copies_land", list(cuda_emulator.COPIES_LAND))
@pytest.mark.parametrize("layout", ["pages", "fragments"])
@pytest.mark.parametrize("num_pages, num_keys, resident_blocks", [
    (600, 3, 264),   # one key tile (13 rows of padding), one chunk of 1,024 pages, part live
    (4097, 20, 2),   # two key tiles; 5 chunks, the last of one page, all in one run of each slice
])
def test_v2_keys_on_the_tensor_cores_match_numpy(matrices, layout, num_pages, num_keys, resident_blocks,
                                                 copies_land):
    # dpf_leaf_bits, then dpf_scan_mma<T> (staging and transposing the pages) or dpf_scan_mma_frag<T>,
    # their cp.async copies landing at the earliest and at the latest a GPU may land them
    matrix, frags = matrices(num_pages)
    batch = key_batch(num_keys, num_pages, matrix.domain_bits, seed=7 * num_keys, key_format=KEY_FORMAT_V2)
    expected = numpy_answers(matrix, batch)
    assert expected.any(axis=1).all()
    scanned = np.ascontiguousarray(matrix.block(0, num_pages)) if layout == "pages" else frags
    assert (cuda_emulator.tensor_core_plan(num_pages, batch, layout, resident_blocks).chunks_per_block > 1) == \
        (resident_blocks == 2)
    got = cuda_emulator.tensor_core_answers(num_pages, scanned, batch, layout, resident_blocks,
                                            copies_land=copies_land)
    assert [np.array_equal(g, e) for g, e in zip(got, expected)] == [True] * num_keys

"""v1 keys on the (emulated) tensor cores over the fragments layout, one key group a block, the
CUDA kernels' own text run on the CPU (tests/cuda_emulator) against the NumPy backend; and the
layout itself."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.backends import cuda_plan
from tests import cuda_emulator
from tests.gpu_engine.emulated import KERNELS, key_batch, matrices, numpy_answers  # noqa: F401 (a fixture)

pytestmark = KERNELS


def test_the_fragments_layout_holds_each_page_bit_where_the_scans_read_it(matrices):
    # bit b of word w of page p: chunk p // 1024, slice w // 8, at fragment_offset(pg, w % 8) + 32 b
    # (bit_products.cuh) with pg = p % 1024 // 32, as bit p % 32 of that word
    matrix, frags = matrices(1500)
    pages = matrix.block(0, 1500)
    rng = np.random.default_rng(5)
    for p, w, b in zip(rng.integers(0, 1500, 200), rng.integers(0, 1024, 200), rng.integers(0, 32, 200)):
        pg, c, ks_half, t = p % 1024 // 32, w % 8, (p % 1024 // 32) >> 2, (p % 1024 // 32) & 3
        at = (p // 1024 * cuda_plan.MMA_SLICES + w // 8) * 8192 + ks_half * 1024 + c * 4 + t + 32 * b
        assert (frags[at] >> (p % 32)) & 1 == (pages[p, w] >> b) & 1, (p, w, b, pg)
    assert not np.any(frags == 0xDEADBEEF)  # every word written (the emulator's buffer starts so)


def test_the_fragments_layout_gives_every_page_back(matrices):
    # fragments_to_pages, what read_page and row writes read: each chunk whole, zeros past the end
    matrix, frags = matrices(1500)
    pages = matrix.block(0, 1500)
    back = np.concatenate([cuda_emulator.chunk_pages(frags, chunk) for chunk in (0, 1)])
    assert np.array_equal(back[:1500], pages) and not back[1500:].any()


@pytest.mark.parametrize("num_pages, num_keys, resident_blocks, chunks_per_block, prefetching", [
    (1, 1, 264, 1, False),      # one page, one key: the chunk is the whole tree
    (255, 16, 264, 1, False),   # one full group over one partial chunk
    (600, 3, 264, 1, False),    # one group of 3 keys (13 padding slots not expanded), 3 chunks
    (700, 21, 264, 1, True),    # two groups of 11 and 10 keys (the keys split evenly), prefetching
    (4097, 33, 1, 17, True),    # one run of 17 chunks, the last of one page; three groups of 11 keys
    (4097, 17, 8, 5, True),     # runs of 5 chunks and a last of 2: two groups of 9 and 8 keys
    (100, 5, 264, 1, False),    # d = 7: chunks of 7 levels, levels 3-6 expanded past the batched ones
    (40, 2, 264, 1, False),     # d = 6: chunks of 6 levels, levels 3-5 past the batched ones
])
@pytest.mark.parametrize("rows_in_flight, prefetch_rows", [(1, 4), (2, 0), (2, 4)])
def test_v1_keys_over_the_fragments_layout_match_numpy(matrices, num_pages, num_keys, resident_blocks,
                                                       chunks_per_block, prefetching, rows_in_flight, prefetch_rows):
    # the rows prefetched into L2 (launches of 2 key groups or more) all lie in the matrix:
    # tensor_core_answers fails otherwise. The tensor cores take every launch here, those of at
    # most V1_FRAG_ALU_KEYS keys too (a variant without the ALU path; the next test has it), with
    # one row of B words in flight a multiplier with rows prefetched 4 ahead (the build other than
    # sm_90a's), or two (sm_90a's) prefetching none (its default) or 4 rows ahead (a variant to time)
    variant = ("V1_FRAG_ALU_KEYS=0", f"V1F_ROWS_IN_FLIGHT={rows_in_flight}", f"V1F_PREFETCH_ROWS={prefetch_rows}")
    matrix, frags = matrices(num_pages)
    batch = key_batch(num_keys, num_pages, matrix.domain_bits, seed=num_pages + num_keys)
    expected = numpy_answers(matrix, batch)
    assert expected.any(axis=1).all()  # no answer is all zeros: a scan that wrote nothing fails
    plan = cuda_emulator.tensor_core_plan(num_pages, batch, "fragments", resident_blocks)
    assert plan.chunks_per_block == chunks_per_block
    before = cuda_emulator.library(variant).emu_prefetches()
    got = cuda_emulator.tensor_core_answers(num_pages, frags, batch, "fragments", resident_blocks, variant=variant)
    assert [np.array_equal(g, e) for g, e in zip(got, expected)] == [True] * num_keys
    assert (cuda_emulator.library(variant).emu_prefetches() > before) == (prefetching and prefetch_rows > 0)

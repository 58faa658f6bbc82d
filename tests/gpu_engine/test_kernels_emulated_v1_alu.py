"""v1 keys over the fragments layout in pairs of key groups (a thread-block cluster) and on the ALU,
the CUDA kernels' own text run on the CPU against the NumPy backend."""
from __future__ import annotations

import numpy as np
import pytest

from tests import cuda_emulator
from tests.gpu_engine.emulated import KERNELS, key_batch, matrices, numpy_answers  # noqa: F401 (a fixture)

pytestmark = KERNELS


@pytest.mark.parametrize("num_pages, num_keys, resident_blocks, chunks_per_block", [
    (255, 17, 264, 1),   # one pair (9 + 8 keys) over one partial chunk
    (700, 21, 264, 1),   # one pair of 11 and 10 keys, 3 chunks, one run (cluster) each
    (4097, 24, 8, 5),    # runs of 5 chunks and a last of 2, the last chunk of one page: 12 + 12 keys
    (1100, 64, 1, 5),    # two pairs (four groups of 16) over one run of 5 chunks, the last of 76 pages
    (100, 18, 264, 1),   # d = 7: one pair of 9 + 9 keys over a chunk of 7 levels
])
@pytest.mark.parametrize("rows", [1, 4])
def test_pairs_of_key_groups_in_a_cluster_match_numpy(matrices, num_pages, num_keys, resident_blocks,
                                                      chunks_per_block, rows):
    # dpf_scan_v1_pair (CudaBackend.v1_pairs): blocks of two key groups run at once as a cluster,
    # each multiplying half of every chunk's slices by both groups' A fragments, the peer's read
    # from its shared memory, handed over on the two blocks' mbarriers; one row of B words in
    # flight (builds without setmaxnreg) or four (sm_90a's); a phase left unfilled or a barrier
    # never completed fails the launch (tensor_core_answers)
    variant = (f"V1P_ROWS={rows}",)
    matrix, frags = matrices(num_pages)
    batch = key_batch(num_keys, num_pages, matrix.domain_bits, seed=5 * num_pages + num_keys)
    expected = numpy_answers(matrix, batch)
    assert expected.any(axis=1).all()
    plan = cuda_emulator.tensor_core_plan(num_pages, batch, "fragments", resident_blocks, v1_pairs=True)
    assert plan.v1_pairs and plan.chunks_per_block == chunks_per_block
    got = cuda_emulator.tensor_core_answers(num_pages, frags, batch, "fragments", resident_blocks, variant=variant,
                                            v1_pairs=True)
    assert [np.array_equal(g, e) for g, e in zip(got, expected)] == [True] * num_keys


@pytest.mark.parametrize("num_pages, num_keys, resident_blocks, chunks_per_block, alu_keys, prefetch", [
    (1, 1, 264, 1, 6, 2),      # one page, one key (the default build: 6 keys, 2 bits ahead)
    (600, 3, 264, 1, 6, 2),    # a single query's 3 keys, 3 chunks (the last part live), a block each
    (4097, 6, 8, 3, 6, 2),     # two queries' keys (the build for 6), runs of 3 chunks and a last of 2
    (4097, 5, 4, 5, 6, 0),     # 5 keys, no prefetch, runs of 5 chunks and a last of 2
    (4097, 7, 4, 5, 6, 2),     # more keys than the ALU's: the tensor cores, in the same build
    (4097, 2, 1, 9, 3, 0),     # a variant of at most 3 keys: runs of 9 chunks and 8, the last of one page
    (4097, 4, 4, 5, 3, 0),     # more keys than that variant's: the tensor cores
    (4097, 3, 1, 9, 3, 4),     # L2 prefetches 4 bits ahead, into the next chunk's
    (4097, 1, 4, 5, 3, 32),    # a whole chunk ahead
])
def test_v1_keys_on_the_alu_over_the_fragments_layout_match_numpy(matrices, num_pages, num_keys, resident_blocks,
                                                                  chunks_per_block, alu_keys, prefetch):
    # launches of at most alu_keys keys multiply on the ALU (V1_FRAG_ALU_KEYS, the host's 6 unless a
    # variant's), prefetching rows `prefetch` bits ahead into L2 (V1F_XOR_PREFETCH):
    # tensor_core_answers fails if a prefetch names an address outside the matrix
    matrix, frags = matrices(num_pages)
    batch = key_batch(num_keys, num_pages, matrix.domain_bits, seed=3 * num_pages + num_keys)
    expected = numpy_answers(matrix, batch)
    assert expected.any(axis=1).all()
    assert cuda_emulator.tensor_core_plan(num_pages, batch, "fragments", resident_blocks).chunks_per_block == \
        chunks_per_block
    variant = (f"V1_FRAG_ALU_KEYS={alu_keys}", f"V1F_XOR_PREFETCH={prefetch}")
    mma_before = cuda_emulator.library(variant).emu_mma_calls()
    prefetches_before = cuda_emulator.library(variant).emu_prefetches()
    got = cuda_emulator.tensor_core_answers(num_pages, frags, batch, "fragments", resident_blocks,
                                            variant=variant)
    assert [np.array_equal(g, e) for g, e in zip(got, expected)] == [True] * num_keys
    # the ALU took the launch (no mma.sync) exactly when it has at most alu_keys keys
    on_alu = num_keys <= alu_keys
    assert (cuda_emulator.library(variant).emu_mma_calls() == mma_before) == on_alu
    assert (cuda_emulator.library(variant).emu_prefetches() > prefetches_before) == (on_alu and prefetch > 0)
    if on_alu:
        # every line the launch loads was prefetched, but for rows 0 .. prefetch - 1 of each run's
        # first chunk (a chunk: 128 slices x 2 halves x 32 rows of 128 bytes); no prefetched line
        # goes unloaded (tensor_core_answers): a prefetch of the wrong line, or a bit too late, fails
        chunks = -(-num_pages // 256)
        runs = -(-chunks // chunks_per_block)
        rows_unprefetched = 32 * chunks if prefetch == 0 else min(prefetch, 32) * runs
        assert cuda_emulator.library(variant).emu_last_loaded_unprefetched_lines() == 128 * 2 * rows_unprefetched

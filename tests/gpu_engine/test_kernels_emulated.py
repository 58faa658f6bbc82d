"""The CUDA kernels' own text run on the CPU (tests/cuda_emulator) against the NumPy backend, where
CI has no GPU: the tree's top, the ALU scans of both key formats over the pages layout, and on the
(emulated) tensor cores v1 keys over the fragments layout (one key group a block, or two a
thread-block cluster) and v2 keys over either (mma.sync; the wgmma scan is sm_90a assembly and is
not emulated). The emulator's model of mma.sync was
checked with the text the H100 had passed every GPU test with (ddde423): it matches here too."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.backends import cuda_plan
from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, KeyBatch, gen_keys
from gpu_engine.matrix import random_matrix
from tests import cuda_emulator

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(cuda_emulator.compiler() is None,
                                 reason=f"no C++ compiler {cuda_emulator.CXX!r} to build the emulated kernels")]


def _batch(num_keys: int, num_pages: int, domain_bits: int, seed: int, key_format: int = KEY_FORMAT_V1) -> KeyBatch:
    rng = np.random.default_rng(seed)
    return KeyBatch.from_keys([gen_keys(int(rng.integers(num_pages)), domain_bits, rng, key_format=key_format)[i % 2]
                               for i in range(num_keys)])


def _answers(matrix, batch) -> np.ndarray:
    return np.asarray(NumpyBackend(workers=2).load(matrix).answer(batch)).view(np.uint32).reshape(
        len(batch.root_seed), -1)


@pytest.fixture(scope="module")
def matrices():
    cache = {}

    def get(num_pages: int):
        if num_pages not in cache:
            matrix = random_matrix(num_pages, seed=num_pages)
            pages = np.ascontiguousarray(matrix.block(0, num_pages))
            cache[num_pages] = matrix, cuda_emulator.to_fragments(pages)
        return cache[num_pages]

    return get


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
    batch = _batch(num_keys, num_pages, matrix.domain_bits, seed=num_pages + num_keys)
    expected = _answers(matrix, batch)
    assert expected.any(axis=1).all()  # no answer is all zeros: a scan that wrote nothing fails
    plan = cuda_emulator.tensor_core_plan(num_pages, batch, "fragments", resident_blocks)
    assert plan.chunks_per_block == chunks_per_block
    before = cuda_emulator.library(variant).emu_prefetches()
    got = cuda_emulator.tensor_core_answers(num_pages, frags, batch, "fragments", resident_blocks, variant=variant)
    assert [np.array_equal(g, e) for g, e in zip(got, expected)] == [True] * num_keys
    assert (cuda_emulator.library(variant).emu_prefetches() > before) == (prefetching and prefetch_rows > 0)


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
    batch = _batch(num_keys, num_pages, matrix.domain_bits, seed=5 * num_pages + num_keys)
    expected = _answers(matrix, batch)
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
    batch = _batch(num_keys, num_pages, matrix.domain_bits, seed=3 * num_pages + num_keys)
    expected = _answers(matrix, batch)
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
    batch = _batch(num_keys, num_pages, matrix.domain_bits, seed=num_pages * num_keys, key_format=key_format)
    expected = _answers(matrix, batch)
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
    batch = _batch(num_keys, num_pages, matrix.domain_bits, seed=7 * num_keys, key_format=KEY_FORMAT_V2)
    expected = _answers(matrix, batch)
    assert expected.any(axis=1).all()
    scanned = np.ascontiguousarray(matrix.block(0, num_pages)) if layout == "pages" else frags
    assert (cuda_emulator.tensor_core_plan(num_pages, batch, layout, resident_blocks).chunks_per_block > 1) == \
        (resident_blocks == 2)
    got = cuda_emulator.tensor_core_answers(num_pages, scanned, batch, layout, resident_blocks,
                                            copies_land=copies_land)
    assert [np.array_equal(g, e) for g, e in zip(got, expected)] == [True] * num_keys

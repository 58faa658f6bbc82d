"""The NumPy backend against the protocol vectors and against a direct per-page reference."""
import hashlib

import numpy as np
import pytest

from gpu_engine.backends.cpu import NumpyBackend, NumpyResident, mask_chunk_bits, reference_answers
from morpho_pir.dpf import DpfKey, KeyBatch, gen_keys
from gpu_engine.matrix import PAGE_BYTES, random_matrix
from tests.protocol_vectors import (
    ANSWER0_PREFIX, ANSWER0_SHA256, ANSWER1_SHA256, KEY0_HEX, KEY1_HEX, protocol_answers, vector_matrix,
    vector_pages,
)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_protocol_answers(workers):
    keys = KeyBatch.from_keys([DpfKey.from_bytes(bytes.fromhex(h)) for h in (KEY0_HEX, KEY1_HEX)])
    answers = NumpyResident(vector_matrix(), workers).answer(keys)
    assert hashlib.sha256(answers[0].tobytes()).hexdigest() == ANSWER0_SHA256
    assert hashlib.sha256(answers[1].tobytes()).hexdigest() == ANSWER1_SHA256
    assert answers[0, :32].tobytes().hex() == ANSWER0_PREFIX
    assert (answers[0] ^ answers[1]).tobytes() == vector_pages()[42].tobytes()


@pytest.mark.parametrize("pages, extra_bits", [(1, 0), (2, 0), (3, 0), (255, 0), (300, 2), (4097, 0)])
def test_matches_direct_formula_on_random_pages(pages, extra_bits):
    rng = np.random.default_rng(pages)
    matrix = random_matrix(pages, seed=pages, domain_bits=max(1, (pages - 1).bit_length()) + extra_bits)
    d = matrix.domain_bits
    keys = KeyBatch.from_keys([gen_keys(int(rng.integers(pages)), d, rng)[i % 2] for i in range(5)])
    got = NumpyBackend(workers=2).load(matrix).answer(keys)
    assert got.shape == (5, PAGE_BYTES)
    assert np.array_equal(got, protocol_answers(matrix, keys))


def test_every_query_in_a_batch_recovers_its_page():
    rng = np.random.default_rng(5)
    matrix = random_matrix(1000, seed=9)
    targets = rng.integers(0, 1000, size=8)
    pairs = [gen_keys(int(t), matrix.domain_bits, rng) for t in targets]
    resident = NumpyBackend(workers=2).load(matrix)
    a = resident.answer(KeyBatch.from_keys([p[0] for p in pairs]))
    b = resident.answer(KeyBatch.from_keys([p[1] for p in pairs]))
    for i, target in enumerate(targets):
        assert (a[i] ^ b[i]).tobytes() == matrix.page(int(target))


def test_batch_equals_one_key_at_a_time_and_small_chunks():
    rng = np.random.default_rng(11)
    matrix = random_matrix(777, seed=1)
    keys = [gen_keys(int(rng.integers(777)), matrix.domain_bits, rng)[0] for _ in range(6)]
    batch = NumpyResident(matrix, 2).answer(KeyBatch.from_keys(keys))
    for i, key in enumerate(keys):
        assert np.array_equal(batch[i], reference_answers(matrix, KeyBatch.from_keys([key]))[0])


def test_row_writes_show_in_answers():
    rng = np.random.default_rng(2)
    matrix = random_matrix(50, seed=4)
    resident = NumpyBackend(workers=1).load(matrix)
    resident.write_rows({16 * 7 + 3: b"\x5a" * 256})
    k0, k1 = gen_keys(7, matrix.domain_bits, rng)
    a = resident.answer(KeyBatch.from_keys([k0]))[0] ^ resident.answer(KeyBatch.from_keys([k1]))[0]
    assert a.tobytes()[3 * 256 : 4 * 256] == b"\x5a" * 256


def test_keys_of_another_depth_are_refused():
    resident = NumpyBackend(workers=1).load(random_matrix(10, seed=0))
    with pytest.raises(ValueError, match="keys have domain_bits 8, matrix has 4"):
        resident.answer(KeyBatch.from_keys([gen_keys(1, 8)[0]]))


@pytest.mark.parametrize("keys, bits, workers, expected", [(3, 16, 1, 16), (96, 25, 2, 12), (3, 16, 2, 15), (1, 1, 4, 0)])
def test_mask_chunk_bits_bounds_memory_and_splits_work(keys, bits, workers, expected):
    assert mask_chunk_bits(keys, bits, workers) == expected

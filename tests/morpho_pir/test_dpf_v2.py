"""v2 keys (docs/PROTOCOL.md section 3.1, early termination): format, refusals, generation, point
and full evaluation, the NumPy backend's answers, and the section 7 "v2 keys" vectors."""
import hashlib

import numpy as np
import pytest

from gpu_engine.backends.cpu import NumpyBackend, NumpyResident, reference_answers
from morpho_pir.dpf import (
    KEY_FORMAT_V1, KEY_FORMAT_V2, V2_MARKER, DpfKey, KeyBatch, KeyFormatError, eval_full,
    eval_pages, eval_point, gen_keys, key_domain_bits, key_format_of, key_length,
    key_length_from_bytes, page_mask, random_keys, tree_depth,
)
from morpho_pir.keygen import gen_key_pairs
from gpu_engine.matrix import PAGE_BYTES, random_matrix
from tests.morpho_pir.test_dpf import _corrupt
from tests.protocol_vectors import (
    KEY0_HEX, ROOT0, ROOT1, V2_ANSWER0_PREFIX, V2_ANSWER0_SHA256, V2_ANSWER1_SHA256, V2_KEY0_HEX,
    V2_KEY1_HEX, V2_LEAVES, V2_SHORT_KEY0_HEX, V2_SHORT_KEY1_HEX, protocol_answers, vector_matrix,
    vector_pages,
)

V2 = KEY_FORMAT_V2


def _roots(root0: bytes, root1: bytes) -> np.ndarray:
    return np.frombuffer(root0 + root1, dtype=np.uint8).reshape(1, 2, 16)


def point_answer(matrix, key: DpfKey) -> bytes:
    """Section 4 for a v2 key by point evaluation, one leaf at a time: the XOR of the pages whose
    selection bit is 1 (bits past num_pages select nothing)."""
    acc = np.zeros(PAGE_BYTES, dtype=np.uint8)
    for leaf in range(-(-matrix.num_pages // 128)):
        bits = int.from_bytes(eval_point(key, leaf), "little")
        for j in range(128):
            page = 128 * leaf + j
            if bits >> j & 1 and page < matrix.num_pages:
                acc ^= np.frombuffer(matrix.page(page), dtype=np.uint8)
    return acc.tobytes()


# -- section 7 vectors --------------------------------------------------------------------------

def test_section_7_v2_vectors_keys_and_leaves():
    key0, key1 = gen_keys(42, 8, root_seeds=(ROOT0, ROOT1), key_format=V2)
    assert (key0.to_bytes().hex(), key1.to_bytes().hex()) == (V2_KEY0_HEX, V2_KEY1_HEX)
    assert len(key0.to_bytes()) == key_length(8, V2) == 54
    pairs = gen_key_pairs([42], 8, root_seeds=_roots(ROOT0, ROOT1), key_format=V2)
    assert (pairs.key_hex(0), pairs.key_hex(1)) == ([V2_KEY0_HEX], [V2_KEY1_HEX])
    full = eval_full(KeyBatch.from_keys([key0, key1]), 2)
    for leaf, (mask0, mask1) in V2_LEAVES.items():
        assert (eval_point(key0, leaf).hex(), eval_point(key1, leaf).hex()) == (mask0, mask1)
        assert full[0, leaf].astype("<u4").tobytes().hex() == mask0
    short = gen_keys(3, 2, root_seeds=(ROOT0, ROOT1), key_format=V2)
    assert [k.to_bytes().hex() for k in short] == [V2_SHORT_KEY0_HEX, V2_SHORT_KEY1_HEX]
    assert len(short[0].to_bytes()) == key_length(2, V2) == 36


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_section_7_v2_vectors_answers(workers):
    keys = KeyBatch.from_bytes(bytes.fromhex(V2_KEY0_HEX + V2_KEY1_HEX), 8)
    answers = NumpyResident(vector_matrix(), workers).answer(keys)
    assert hashlib.sha256(answers[0].tobytes()).hexdigest() == V2_ANSWER0_SHA256
    assert hashlib.sha256(answers[1].tobytes()).hexdigest() == V2_ANSWER1_SHA256
    assert answers[0, :32].tobytes().hex() == V2_ANSWER0_PREFIX
    assert (answers[0] ^ answers[1]).tobytes() == vector_pages()[42].tobytes()
    key0 = DpfKey.from_bytes(bytes.fromhex(V2_KEY0_HEX))
    assert point_answer(vector_matrix(), key0) == answers[0].tobytes()


# -- format -------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 6, 7, 8, 9, 16, 25, 32])
def test_round_trip_lengths_and_format_marker(d):
    rng = np.random.default_rng(d)
    for key in gen_keys(int(rng.integers(1 << d)), d, rng, key_format=V2):
        raw = key.to_bytes()
        assert raw[18] == V2_MARKER and raw[19] == d
        assert len(raw) == key_length(d, V2) == 36 + 18 * max(d - 7, 0)
        assert len(key.cw_seed) == key.tree_depth == tree_depth(d, V2) == max(d - 7, 0)
        assert key_format_of(raw) == V2 and key_domain_bits(raw) == d
        assert key_length_from_bytes(raw, d) == len(raw)
        assert key_length_from_bytes(raw * 3, d) == len(raw)
        assert DpfKey.from_bytes(raw, expected_domain_bits=d) == key
        assert KeyBatch.from_bytes(raw, d).to_bytes() == raw
        assert KeyBatch.from_keys([key]).to_bytes() == raw


def test_the_formats_never_parse_as_each_other():
    v1 = bytes.fromhex(KEY0_HEX)
    assert key_format_of(v1) == KEY_FORMAT_V1 and key_length_from_bytes(v1, 8) == 179
    assert key_length(8) == 179  # the v1 length, as the engine's wire calls it
    # byte 18 of every v1 key is its domain_bits (1..32), never the v2 marker (0x82)
    for d in range(1, 33):
        assert d != V2_MARKER
    # a v2 key read by a v1-only parser fails on byte 18, never as a shorter v1 key
    v2 = bytes.fromhex(V2_KEY0_HEX)
    assert not 1 <= v2[18] <= 32


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:-1], "v2 key is 53 bytes but its domain_bits byte says 8, which needs 54"),
    (lambda b: b + b"\0" * 18, "v2 key is 72 bytes"),
    (lambda b: b[:19], "v2 key is 19 bytes, shorter than the 20-byte header"),
    (lambda b: _corrupt(b, 16, 2), "root_t byte is 2, expected 0 or 1"),
    (lambda b: _corrupt(b, 17, 3), "party byte is 3, expected 0 or 1"),
    (lambda b: _corrupt(b, 19, 0), r"v2 key's domain_bits byte \(byte 19\) is 0"),
    (lambda b: _corrupt(b, 19, 33), r"v2 key's domain_bits byte \(byte 19\) is 33"),
    (lambda b: _corrupt(b, 20 + 16, 4), "level 0 t_cw_left byte is 4, expected 0 or 1"),
    (lambda b: _corrupt(b, 20 + 17, 2), "level 0 t_cw_right byte is 2, expected 0 or 1"),
    (lambda b: _corrupt(b, 18, 0x83), r"domain_bits byte is 131, expected 1..32 \(or 0x82"),
])
def test_malformed_v2_keys_say_what_is_wrong(mutate, message):
    raw = mutate(bytes.fromhex(V2_KEY0_HEX))
    with pytest.raises(KeyFormatError, match=message):
        DpfKey.from_bytes(raw)


def test_v2_key_for_another_domain_is_refused():
    with pytest.raises(KeyFormatError, match="key has domain_bits 8, this server's epoch has domain_bits 9"):
        DpfKey.from_bytes(bytes.fromhex(V2_KEY0_HEX), expected_domain_bits=9)


def test_batch_parse_refuses_mixed_formats_and_bad_bytes():
    v2 = bytes.fromhex(V2_KEY0_HEX)
    with pytest.raises(KeyFormatError, match="key 1 has domain_bits 9, expected 8"):
        KeyBatch.from_bytes(v2 + _corrupt(v2, 19, 9), 8)
    with pytest.raises(KeyFormatError, match="key 2 has a root_t, party or t_cw byte"):
        KeyBatch.from_bytes(v2 * 2 + _corrupt(v2, 37, 5), 8)
    with pytest.raises(KeyFormatError, match="not a whole number of 54-byte v2 keys"):
        KeyBatch.from_bytes(v2 + bytes.fromhex(KEY0_HEX), 8)
    # three v1-sized rows whose second one is a v2 key padded out: one format per request
    v1 = bytes.fromhex(KEY0_HEX)
    mixed = v1 + (v2 + bytes(179 - 54)) + v1
    with pytest.raises(KeyFormatError, match="key 1 has domain_bits 130, expected 8"):
        KeyBatch.from_bytes(mixed, 8)
    v2_rows = v2 + _corrupt(v2, 18, 8)
    with pytest.raises(KeyFormatError, match="key 1 has byte 18 8, expected 0x82"):
        KeyBatch.from_bytes(v2_rows, 8)
    with pytest.raises(ValueError, match="key 1 is a v1 key, key 0 a v2 key"):
        KeyBatch.from_keys([DpfKey.from_bytes(v2), DpfKey.from_bytes(v1)])


def test_batch_slices_keep_the_format():
    rng = np.random.default_rng(3)
    pairs = gen_key_pairs(rng.integers(0, 1 << 12, size=5), 12, rng=rng, key_format=V2)
    raw = b"".join(pairs.key_bytes(1))
    batch = KeyBatch.from_bytes(raw, 12)
    assert batch.key_format == V2 and batch.tree_depth == 5
    part = batch.keys(1, 3)
    assert part.to_bytes() == raw[1 * 126:3 * 126]
    assert part.key_format == V2
    np.testing.assert_array_equal(pairs.key_batch(1).cw_seed, batch.cw_seed)
    assert pairs.key_batch(1).to_bytes() == raw
    assert len(random_keys(4, 12, rng, key_format=V2).to_bytes()) == 4 * 126


# -- generation and evaluation ------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 9])
def test_every_target_of_small_domains_xors_to_the_one_hot_page(d):
    pages = 1 << d
    targets = list(range(pages))
    pairs = gen_key_pairs(targets, d, key_format=V2)
    masks = [eval_pages(pairs.key_batch(party), pages) for party in (0, 1)]
    xor = masks[0] ^ masks[1]
    expected = np.zeros_like(xor)
    expected[np.arange(pages), np.arange(pages)] = 0xFFFFFFFF
    assert np.array_equal(xor, expected)
    # the leaves XOR to the one-hot 128-bit vector at the target's position, zero elsewhere
    leaves = [eval_full(pairs.key_batch(party), 1 << tree_depth(d, V2)) for party in (0, 1)]
    for target in targets:
        onehot = (1 << (target % 128)).to_bytes(16, "little")
        for leaf in range(leaves[0].shape[1]):
            got = (leaves[0][target, leaf] ^ leaves[1][target, leaf]).astype("<u4").tobytes()
            assert got == (onehot if leaf == target >> 7 else bytes(16)), (target, leaf)


@pytest.mark.parametrize("d", [10, 13, 20, 25])
def test_random_targets_point_eval_and_batch_generation_agree(d):
    rng = np.random.default_rng(40 + d)
    targets = [0, (1 << d) - 1] + [int(t) for t in rng.integers(0, 1 << d, size=4)]
    pairs = gen_key_pairs(targets, d, rng=rng, key_format=V2)
    for i, target in enumerate(targets):
        roots = (pairs.root_seeds[i, 0].tobytes(), pairs.root_seeds[i, 1].tobytes())
        key0, key1 = gen_keys(target, d, root_seeds=roots, key_format=V2)
        assert (pairs.key_bytes(0)[i], pairs.key_bytes(1)[i]) == (key0.to_bytes(), key1.to_bytes())
        for page in {target, target ^ 1, target ^ 128, 0, (1 << d) - 1}:
            m0, m1 = page_mask(key0, page), page_mask(key1, page)
            assert m0 in (bytes(16), b"\xff" * 16)
            assert bytes(a ^ b for a, b in zip(m0, m1)) == (b"\xff" * 16 if page == target else bytes(16))


def test_full_eval_equals_point_eval():
    rng = np.random.default_rng(9)
    key0, key1 = gen_keys(700, 12, rng, key_format=V2)
    batch = KeyBatch.from_keys([key0, key1])
    full = eval_full(batch, 32)
    pages = eval_pages(batch, 4096)
    for leaf in range(32):
        assert eval_point(key1, leaf) == full[1, leaf].astype("<u4").tobytes()
    for page in rng.integers(0, 4096, size=40):
        assert page_mask(key0, int(page)) == pages[0, page].astype("<u4").tobytes()
    assert np.array_equal(eval_pages(batch, 1000), pages[:, :1000])


# -- the NumPy backend --------------------------------------------------------------------------

@pytest.mark.parametrize("pages, extra_bits", [(1, 0), (2, 0), (3, 0), (255, 0), (300, 2), (4097, 0)])
def test_numpy_backend_equals_point_evaluation(pages, extra_bits):
    rng = np.random.default_rng(pages)
    matrix = random_matrix(pages, seed=pages, domain_bits=max(1, (pages - 1).bit_length()) + extra_bits)
    d = matrix.domain_bits
    targets = [int(t) for t in rng.integers(0, pages, size=3)]
    pairs = gen_key_pairs(targets, d, rng=rng, key_format=V2)
    keys = [DpfKey.from_bytes(raw) for party in (0, 1) for raw in pairs.key_bytes(party)]
    batch = KeyBatch.from_keys(keys)
    got = NumpyBackend(workers=2).load(matrix).answer(batch)
    assert np.array_equal(got, protocol_answers(matrix, batch))
    for i, key in enumerate(keys):
        assert got[i].tobytes() == point_answer(matrix, key), (pages, i)
    for i, target in enumerate(targets):
        assert (got[i] ^ got[i + 3]).tobytes() == matrix.page(target)


@pytest.mark.parametrize("pages, d", [(1, 1), (3, 2), (3, 7), (100, 7)])
def test_bits_past_num_pages_select_nothing(pages, d):
    # a depth-0 key whose leaf is 128 ones: the answer is the XOR of the pages that exist
    matrix = random_matrix(pages, seed=pages, domain_bits=d)
    ones = KeyBatch(domain_bits=d, root_seed=np.full((1, 4), 0xFFFFFFFF, np.uint32),
                    root_t=np.zeros(1, np.uint8), cw_seed=np.zeros((1, 0, 4), np.uint32),
                    cw_t=np.zeros((1, 0, 2), np.uint8), final_cw=np.zeros((1, 4), np.uint32),
                    key_format=V2)
    expected = np.zeros(PAGE_BYTES, dtype=np.uint8)
    for page in range(pages):
        expected ^= np.frombuffer(matrix.page(page), dtype=np.uint8)
    assert np.array_equal(reference_answers(matrix, ones)[0], expected)
    assert np.array_equal(NumpyResident(matrix, 3).answer(ones)[0], expected)
    assert np.array_equal(protocol_answers(matrix, ones)[0], expected)


def test_protocol_md_states_the_v2_vectors_and_lengths_the_code_computes():
    # docs/PROTOCOL.md section 7 ("v2 keys") and section 3.1 print what this code produces
    from tests.conftest import REPO

    text = (REPO / "docs" / "PROTOCOL.md").read_text()
    section = text[text.index("### 3.1 v2 keys"):text.index("## 4. The answer")]
    vectors = text[text.index("**v2 keys** (section 3.1)"):text.index("## 8.")]
    for value in (V2_KEY0_HEX, V2_KEY1_HEX, V2_ANSWER0_SHA256, V2_ANSWER1_SHA256,
                  V2_ANSWER0_PREFIX, V2_SHORT_KEY0_HEX, V2_SHORT_KEY1_HEX,
                  *[mask for pair in V2_LEAVES.values() for mask in pair]):
        assert value in vectors, value
    lengths = {d: key_length(d, V2) for d in (7, 8, 16, 25)}
    assert (f"36 for `d <= 7`, {lengths[8]} at d = 8, {lengths[16]} at\nd = 16, {lengths[25]} "
            "at d = 25") in section
    assert f"| 18 | 1 | `{V2_MARKER:#x}`" in section

"""DPF and PRG against docs/PROTOCOL.md section 7 and the algebra every key pair must satisfy."""
import numpy as np
import pytest

from morpho_pir.dpf import DpfKey, KeyBatch, KeyFormatError, eval_full, eval_point, gen_keys, key_length
from morpho_pir.prg import chacha_block, expand
from tests.protocol_vectors import KEY0_HEX, KEY1_HEX, MASKS, ROOT0, ROOT1


def _hex_words(words):
    return [hex(int(w)) for w in words]


@pytest.mark.parametrize("seed, left, right, tl, tr", [
    ([0, 1, 2, 3], [0x0B75202B, 0x0083FB07, 0x0EB85FEE, 0x0F884943],
     [0x4E1E8F27, 0x592FE280, 0x95A2C7B5, 0x2FA9A927], 0, 0),
    ([0x12345678, 0x9ABCDEF0, 0xFEDCBA98, 0x76543210], [0x2189D08E, 0x32A00FDE, 0xD7A9359A, 0x5078503A],
     [0x17C2235A, 0xB88450B8, 0xA1045DC6, 0xCCF11730], 0, 1),
])
def test_expand_vectors(seed, left, right, tl, tr):
    out_l, out_r, out_tl, out_tr = expand(np.array([seed], dtype=np.uint32))
    assert _hex_words(out_l[0]) == _hex_words(left)
    assert _hex_words(out_r[0]) == _hex_words(right)
    assert (int(out_tl[0]), int(out_tr[0])) == (tl, tr)


def test_twenty_rounds_is_rfc8439_chacha20():
    # RFC 8439 section 2.3.2: key 00..1f, counter 1, nonce 000000090000004a00000000
    key = np.frombuffer(bytes(range(32)), dtype="<u4")[None, :]
    block = chacha_block(key, 1, nonce=(0x09000000, 0x4A000000, 0), rounds=20)
    assert block.astype("<u4").tobytes().hex() == (
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
    )


def test_twenty_rounds_matches_cryptography_chacha20():
    algorithms = pytest.importorskip("cryptography.hazmat.primitives.ciphers.algorithms")
    from cryptography.hazmat.primitives.ciphers import Cipher

    key = bytes(range(7, 39))
    nonce16 = (5).to_bytes(4, "little") + bytes(12)  # counter 5, zero nonce
    stream = Cipher(algorithms.ChaCha20(key, nonce16), mode=None).encryptor().update(bytes(64))
    block = chacha_block(np.frombuffer(key, dtype="<u4")[None, :], 5, rounds=20)
    assert block.astype("<u4").tobytes() == stream


def test_keygen_matches_spec_bytes():
    key0, key1 = gen_keys(42, 8, root_seeds=(ROOT0, ROOT1))
    assert key0.to_bytes().hex() == KEY0_HEX
    assert key1.to_bytes().hex() == KEY1_HEX
    assert len(key0.to_bytes()) == key_length(8) == 179


@pytest.mark.parametrize("x", sorted(MASKS))
def test_point_and_full_masks_match_spec(x):
    key0 = DpfKey.from_bytes(bytes.fromhex(KEY0_HEX))
    key1 = DpfKey.from_bytes(bytes.fromhex(KEY1_HEX))
    full = eval_full(KeyBatch.from_keys([key0, key1]), 256)
    for party, key in enumerate((key0, key1)):
        assert eval_point(key, x).hex() == MASKS[x][party]
        assert full[party, x].astype("<u4").tobytes().hex() == MASKS[x][party]


def test_key_bytes_round_trip_on_random_keys():
    rng = np.random.default_rng(1)
    for d in (1, 5, 25):
        for key in gen_keys(int(rng.integers(1 << d)), d, rng):
            assert DpfKey.from_bytes(key.to_bytes(), expected_domain_bits=d) == key


@pytest.mark.parametrize("d", [1, 2, 3, 7, 10])
def test_point_eval_equals_full_eval_on_random_keys(d):
    rng = np.random.default_rng(d)
    key0, key1 = gen_keys(int(rng.integers(1 << d)), d, rng)
    full = eval_full(KeyBatch.from_keys([key0, key1]), 1 << d)
    for x in rng.integers(0, 1 << d, size=12):
        assert eval_point(key0, int(x)) == full[0, x].astype("<u4").tobytes()
        assert eval_point(key1, int(x)) == full[1, x].astype("<u4").tobytes()


@pytest.mark.parametrize("d", list(range(1, 21)))
def test_two_parties_xor_to_point_function(d):
    rng = np.random.default_rng(100 + d)
    target = int(rng.integers(1 << d))
    key0, key1 = gen_keys(target, d, rng)
    full = eval_full(KeyBatch.from_keys([key0, key1]), 1 << d)
    combined = full[0] ^ full[1]
    expected = np.zeros_like(combined)
    expected[target] = 0xFFFFFFFF
    assert np.array_equal(combined, expected)
    assert not np.array_equal(full[0], np.zeros_like(full[0]))  # a share alone looks random


def test_pruned_full_eval_is_a_prefix_of_the_whole_domain():
    rng = np.random.default_rng(7)
    keys = KeyBatch.from_keys([gen_keys(3, 10, rng)[0] for _ in range(3)])
    assert np.array_equal(eval_full(keys, 1000), eval_full(keys, 1024)[:, :1000])


def _corrupt(data: bytes, offset: int, value: int) -> bytes:
    out = bytearray(data)
    out[offset] = value
    return bytes(out)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:-1], "178 bytes but its domain_bits byte says 8, which needs 179"),
    (lambda b: b[:10], "shorter than the 19-byte header"),
    (lambda b: _corrupt(b, 16, 2), "root_t byte is 2, expected 0 or 1"),
    (lambda b: _corrupt(b, 17, 7), "party byte is 7, expected 0 or 1"),
    (lambda b: _corrupt(b, 18, 0), "domain_bits byte is 0"),
    (lambda b: _corrupt(b, 19 + 18 * 3 + 16, 5), "level 3 t_cw_left byte is 5, expected 0 or 1"),
    (lambda b: _corrupt(b, 19 + 18 * 7 + 17, 9), "level 7 t_cw_right byte is 9, expected 0 or 1"),
])
def test_malformed_keys_say_what_is_wrong(mutate, message):
    with pytest.raises(KeyFormatError, match=message):
        DpfKey.from_bytes(mutate(bytes.fromhex(KEY0_HEX)))


def test_key_for_another_domain_is_refused():
    with pytest.raises(KeyFormatError, match="key has domain_bits 8, this server's epoch has domain_bits 16"):
        DpfKey.from_bytes(bytes.fromhex(KEY0_HEX), expected_domain_bits=16)


def test_gen_keys_rejects_target_outside_domain():
    with pytest.raises(ValueError, match="outside"):
        gen_keys(256, 8)


def test_a_parsed_batch_sends_on_its_own_bytes_and_slices_agree_with_its_keys():
    # The web and bulk paths forward KeyBatch.from_bytes(body) to the engine server as
    # to_bytes(); slices of it (one launch of a bulk chunk) must be exactly those keys.
    rng = np.random.default_rng(5)
    keys = [k for _ in range(4) for k in gen_keys(int(rng.integers(1 << 9)), 9, rng=rng)]
    raw = b"".join(key.to_bytes() for key in keys)
    size = key_length(9)
    parsed = KeyBatch.from_bytes(raw, 9)
    assert parsed.to_bytes() == raw
    built = KeyBatch.from_keys(keys)  # no bytes kept: to_bytes encodes
    assert built.to_bytes() == raw
    for start, stop in [(0, 3), (3, 8), (7, 8)]:
        part = parsed.keys(start, stop)
        assert len(part) == stop - start
        assert part.to_bytes() == raw[start * size:stop * size]
        assert part.to_bytes() == built.keys(start, stop).to_bytes()
        np.testing.assert_array_equal(part.cw_seed, KeyBatch.from_keys(keys[start:stop]).cw_seed)
    with pytest.raises(IndexError):
        parsed.keys(5, 9)

"""JSON keys checked in one vectorised pass accept exactly what the field-by-field check accepts."""
import numpy as np
import pytest
from rest_framework import serializers

from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, KeyBatch
from morpho_pir.keygen import gen_key_pairs
from queries.api.serializers import (
    BatchQuerySerializer,
    JsonObjectSerializer,
    PageQuerySerializer,
    keys_checked_at_once,
)

D = 10


def _hex_keys(count: int, seed: int, key_format: int = KEY_FORMAT_V1) -> list:
    targets = np.random.default_rng(seed).integers(0, 1 << D, count)
    return gen_key_pairs(targets, D, key_format=key_format).key_hex(seed % 2)


def _field_by_field(query):
    """The validated key bytes by the per-field path alone, or None when it refuses."""
    serializer = PageQuerySerializer(data=query, context={"domain_bits": D})
    try:
        return b"".join(JsonObjectSerializer.to_internal_value(serializer, query)["keys"])
    except serializers.ValidationError:
        return None


def _mutations(keys: list, rng) -> list:
    key = keys[0]
    body = key[2:] if key.startswith("0x") else key
    bad = [
        key.upper(), "0X" + body, body, key + "00", key[:-2], key[:-1], key + " ", " " + key,
        key[:20] + " " + key[21:], key[:20] + "g" + key[21:], key[:20] + "é" + key[21:], 7, None,
        body[:36] + "02" + body[38:],  # root_t 2
        body[:36] + "01" + body[38:],  # root_t flipped: still a key
        body[:34] + "ff" + body[36:],  # party 0xff
        body[:36] + format(D + 1, "02x") + body[38:],  # domain_bits byte of another domain
        body[:-2] + "ab",  # final_cw: any bytes
    ]
    return [[m] + keys[1:] for m in bad] + [keys[:2], keys + keys[:1], "nope", {"k": 1}]


@pytest.mark.parametrize("key_format", [KEY_FORMAT_V1, KEY_FORMAT_V2])
@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_the_field_by_field_check(seed, key_format):
    rng = np.random.default_rng(seed)
    keys = _hex_keys(3, seed, key_format)
    cases = [{"keys": keys}, {"keys": keys, "extra": True}, []] + \
            [{"keys": m} for m in _mutations(keys, rng)]
    for query in cases:
        slow = _field_by_field(query) if isinstance(query, dict) else None
        fast = keys_checked_at_once([query], D)
        assert fast is None or slow == fast.to_bytes(), query
        if isinstance(query, dict) and query.get("keys") is keys:
            assert fast is not None  # the well-formed body takes the quick path


def test_a_batch_with_one_bad_key_falls_back_and_names_it():
    queries = [{"keys": _hex_keys(3, s)} for s in range(4)]
    queries[2]["keys"][1] = queries[2]["keys"][1][:-2]
    assert keys_checked_at_once(queries, D) is None
    serializer = BatchQuerySerializer(data={"queries": queries}, context={"domain_bits": D})
    assert not serializer.is_valid()
    assert "2" in str(serializer.errors) and "key length" in str(serializer.errors)


def test_whole_bodies_take_the_quick_path_with_the_same_bytes():
    queries = [{"keys": _hex_keys(3, s)} for s in range(5)]
    batch = BatchQuerySerializer(data={"queries": queries}, context={"domain_bits": D})
    assert batch.is_valid()
    single = PageQuerySerializer(data=queries[0], context={"domain_bits": D})
    assert single.is_valid()
    expected = b"".join(bytes.fromhex(k[2:] if k.startswith("0x") else k)
                        for q in queries for k in q["keys"])
    assert batch.validated_data["key_batch"].to_bytes() == expected
    assert b"".join(single.validated_data["keys"]) == expected[:len(expected) // 5]
    assert single.validated_data["key_batch"].to_bytes() == expected[:len(expected) // 5]


def test_keys_of_two_formats_or_a_format_not_taken_fall_back():
    v1, v2 = _hex_keys(3, 1), _hex_keys(3, 2, KEY_FORMAT_V2)
    assert keys_checked_at_once([{"keys": v1}, {"keys": v2}], D) is None
    assert keys_checked_at_once([{"keys": v2[:2] + v1[:1]}], D) is None
    assert keys_checked_at_once([{"keys": v2}], D, key_formats=(KEY_FORMAT_V1,)) is None
    assert keys_checked_at_once([{"keys": v2}, {"keys": v2}], D).key_format == KEY_FORMAT_V2


def test_the_field_by_field_path_hands_the_view_the_same_batch(monkeypatch):
    # a body the quick check leaves to the field-by-field path still reaches the view as one
    # KeyBatch, parsed from the keys that path checked
    from queries.api import serializers as module

    monkeypatch.setattr(module, "keys_checked_at_once", lambda *args, **kwargs: None)
    queries = [{"keys": _hex_keys(3, s, KEY_FORMAT_V2)} for s in range(2)]
    expected = b"".join(bytes.fromhex(k[2:] if k.startswith("0x") else k)
                        for q in queries for k in q["keys"])
    batch = BatchQuerySerializer(data={"queries": queries}, context={"domain_bits": D})
    single = PageQuerySerializer(data=queries[0], context={"domain_bits": D})
    assert batch.is_valid() and single.is_valid()
    parsed, reference = batch.validated_data["key_batch"], KeyBatch.from_bytes(expected, D)
    assert parsed.to_bytes() == expected and parsed.key_format == KEY_FORMAT_V2
    for name in ("root_seed", "root_t", "cw_seed", "cw_t", "final_cw"):
        assert np.array_equal(getattr(parsed, name), getattr(reference, name)), name
    assert single.validated_data["key_batch"].to_bytes() == expected[:len(expected) // 2]
    assert b"".join(single.validated_data["keys"]) == expected[:len(expected) // 2]

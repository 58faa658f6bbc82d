"""The key rules of docs/PROTOCOL.md section 5.4, in their order, and the choices section 5 makes
where the protocol could be read two ways: the same code for the same key bytes in JSON and in
binary (section 7's "Refusals" vectors), the request's format from its first key, the targets
of a small domain."""
from __future__ import annotations

import pytest

from morpho_pir.dpf import KEY_FORMAT_V2, gen_keys, key_length
from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
from tests.protocol_vectors import (ANSWER0_SHA256, ANSWER1_SHA256, KEY0_HEX, KEY1_HEX, REFUSALS,
                                    V2_KEY0_HEX, V2_KEY1_HEX, key_bytes)
from tests.queries.test_wire_format import (  # noqa: F401 - api
    BATCH, BIN, SINGLE, api, pages_of, post, post_json, sha)

V1, V2 = bytes.fromhex(KEY0_HEX), bytes.fromhex(V2_KEY0_HEX)


def errors(response) -> list[tuple[str, str, str]]:
    assert response.status_code == 400, response.content
    return [(e["field"], e["code"], e["message"]) for e in response.json()["errors"]]


def both(api, keys: list[bytes]) -> tuple[list, list]:
    """The errors of one query of `keys`, sent as JSON and as binary."""
    hexed = errors(post_json(api, BATCH, {"queries": [{"keys": [k.hex() for k in keys]}]}))
    raw = errors(post(api, BATCH, b"".join(keys)))
    return hexed, raw


# The decisions section 7's "Refusals" table publishes, a row or more each: a row taken out of the
# document, or one added without a test here, fails
REFUSAL_ROWS = (
    "format byte 0x80, v1", "format byte 0x81, v1", "format byte 0xff, v1", "format byte 0x80, v2",
    "v1 domain_bits 0", "v1 domain_bits 9, the epoch's length", "v2 domain_bits 40", "v2 party 2",
    "v2 key in a v1 batch", "v2 marker in a v1 request", "bad first key with a format",
    "first key without a format", "body whose first key has no format", "first key without byte 18",
    "no byte 18, v1 request", "no byte 18, v2 request", "no byte 19, v2 request", "0X prefix",
    "v2 key of the epoch's length, another domain")


def test_the_refusal_table_holds_every_published_decision():
    assert [r.label for r in REFUSALS] == list(REFUSAL_ROWS)


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.label)
def test_the_refusal_vectors_are_what_the_api_answers(request, refusal):
    api = request.getfixturevalue({8: "api", 4: "small"}[refusal.domain_bits])
    response = post_json(api, BATCH, {"queries": [{"keys": keys} for keys in refusal.queries]})
    if refusal.status == 200:
        assert not refusal.binary and refusal.errors == []
        answers = {KEY0_HEX: ANSWER0_SHA256, KEY1_HEX: ANSWER1_SHA256}  # section 7's "Wire"
        assert [[sha(page) for page in query] for query in pages_of(response)] == [
            [answers[key_bytes(k).hex()] for k in keys] for keys in refusal.queries]
        return
    assert response.status_code == refusal.status
    assert errors(response) == refusal.errors
    assert len(refusal.body_bytes) == (len(refusal.errors) if refusal.binary else 0)
    if refusal.binary:
        body = b"".join(key_bytes(k) for keys in refusal.queries for k in keys)
        raw = post(api, BATCH, body)
        assert raw.status_code == refusal.status
        assert errors(raw) == [(f, c, f"{m} (body bytes {span})")
                               for (f, c, m), span in zip(refusal.errors, refusal.body_bytes)]


def test_a_body_whose_first_key_names_no_format_is_refused_at_that_key(api):
    unknown = bytearray(V1)
    unknown[18] = 0xFF
    for path, field in ((BATCH, "queries[0].keys[0]"), (SINGLE, "keys[0]")):
        (error,) = errors(post(api, path, bytes(unknown) + V1 + V1))
        assert error[:2] == (field, "key_format")
        assert error[2] == ("format byte (byte 18) is 0xff: expected 1..32 (a v1 key's domain_bits) "
                            "or 0x82 (a v2 key) (body bytes 0 to 18)")


def test_every_key_follows_the_requests_first_key_not_its_querys(api):
    body = {"queries": [{"keys": [KEY0_HEX] * 3}, {"keys": [V2_KEY0_HEX, KEY0_HEX, KEY0_HEX]}]}
    assert [(f, c) for f, c, _ in errors(post_json(api, BATCH, body))] == [
        ("queries[1].keys[0]", "key_format")]  # the v1 keys after it are the request's format
    bad_party = bytearray(V1)
    bad_party[17] = 2  # a bad first key still names the request's format: v1
    body = {"queries": [{"keys": [bad_party.hex(), V2_KEY0_HEX, KEY0_HEX]}]}
    assert [(f, c) for f, c, _ in errors(post_json(api, BATCH, body))] == [
        ("queries[0].keys[0]", "key_format"), ("queries[0].keys[1]", "key_format")]


def test_a_first_key_without_a_format_leaves_the_request_without_one(api):
    for first in (7, "zz", "00" * 10):  # not a string, not hex, no byte 18
        body = {"queries": [{"keys": [first, V2_KEY0_HEX, KEY0_HEX]}]}
        assert [f for f, _, _ in errors(post_json(api, BATCH, body))] == ["queries[0].keys[0]"]


@pytest.mark.parametrize("request_key, expected", [(V1, "expected 179 bytes (35 + 18 * domain_bits 8)"),
                                                   (V2, "expected 54 bytes (a v2 key")])
def test_a_key_too_short_for_byte_18_is_measured_by_the_requests_format(api, request_key, expected):
    short = "ab" * 18  # 18 bytes: no byte 18
    body = {"queries": [{"keys": [request_key.hex(), short, request_key.hex()]}]}
    ((field, code, message),) = errors(post_json(api, BATCH, body))
    assert (field, code) == ("queries[0].keys[1]", "key_length") and expected in message


def test_hex_takes_either_prefix(api):
    keys = [V2_KEY0_HEX, "0x" + V2_KEY1_HEX, "0X" + V2_KEY0_HEX.upper()]
    assert post_json(api, SINGLE, {"keys": keys}).status_code == 200


@pytest.fixture
def small(serve_matrix, tmp_path):
    """A 12-page matrix: domain_bits 4, where every v2 key of d <= 7 is 36 bytes long."""
    path = write_matrix_file(tmp_path / "small.bin", 12, seed=3)
    write_epoch_metadata(path, epoch_id=1)
    serve_matrix(path)
    from rest_framework.test import APIClient
    return APIClient()


def test_a_v2_key_of_another_small_domain_is_a_domain_bits_refusal(small):
    other = gen_keys(5, 5, key_format=KEY_FORMAT_V2)[0].to_bytes()  # d = 5, 36 bytes too
    mine = gen_keys(5, 4, key_format=KEY_FORMAT_V2)[0].to_bytes()
    assert len(other) == len(mine) == key_length(4, KEY_FORMAT_V2) == 36
    hexed, raw = both(small, [mine, other, mine])
    assert [(f, c) for f, c, _ in hexed] == [(f, c) for f, c, _ in raw] == [
        ("queries[0].keys[1]", "domain_bits")]
    assert "expected 4 (this server's epoch), got 5 (a v2 key of 36 bytes)" in hexed[0][2]


def test_targets_are_the_domain_and_those_past_the_pages_read_zeros(small):
    with pytest.raises(ValueError, match=r"target 16 is outside \[0, 2\*\*4\)"):
        gen_keys(16, 4, key_format=KEY_FORMAT_V2)
    for key_format in (1, KEY_FORMAT_V2):
        key0, key1 = gen_keys(13, 4, key_format=key_format)  # page 13 of 12
        answers = []
        for key in (key0, key1):
            response = post(small, SINGLE, key.to_bytes() * 3, accept=BIN)
            assert response.status_code == 200
            answers.append(response.content[:4096])
        assert bytes(a ^ b for a, b in zip(*answers)) == bytes(4096)

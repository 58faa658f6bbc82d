"""v2 keys over HTTP (docs/PROTOCOL.md section 3.1 and section 7's "v2 keys" vectors): both
encodings on the same endpoints, /epoch naming the formats, one format per request, bulk refusing."""
from __future__ import annotations

import hashlib
import json

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from morpho_pir.dpf import KEY_FORMAT_V2, gen_keys, key_length
from morpho_pir.keygen import gen_key_pairs
from tests.conftest import VECTOR_EPOCH
from tests.protocol_vectors import (
    KEY0_HEX, V2_ANSWER0_SHA256, V2_ANSWER1_SHA256, V2_KEY0_HEX, V2_KEY1_HEX, vector_pages,
)
from tests.queries.test_wire_format import (  # noqa: F401 - api: the fixture
    BATCH, BIN, D, PAGE, SINGLE, api, post, post_json, with_byte,
)

V2_LEN = key_length(D, KEY_FORMAT_V2)  # 54
V2_KEY0, V2_KEY1 = bytes.fromhex(V2_KEY0_HEX), bytes.fromhex(V2_KEY1_HEX)


def answers(response) -> list[bytes]:
    """Every answer of a 200, in order, in either encoding."""
    assert response.status_code == 200, response.content
    if response["Content-Type"] == BIN:
        return [response.content[i:i + PAGE] for i in range(0, len(response.content), PAGE)]
    body = response.json()
    results = body["results"] if "results" in body else [body]
    return [bytes.fromhex(page[2:]) for result in results for page in result["pages"]]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_epoch_advertises_both_key_formats(api):
    assert api.get("/epoch").json()["key_formats"] == ["v1", "v2"]


@pytest.mark.parametrize("accept", [None, BIN])
@pytest.mark.parametrize("encoding", ["json", "binary"])
def test_section_7_v2_vectors_over_http(api, encoding, accept):
    keys = [V2_KEY0, V2_KEY1, V2_KEY0]
    if encoding == "json":
        response = post_json(api, SINGLE, {"keys": [k.hex() for k in keys]}, accept)
    else:
        response = post(api, SINGLE, b"".join(keys), accept=accept)
    a0, a1, a2 = answers(response)
    assert (sha(a0), sha(a1), sha(a2)) == (V2_ANSWER0_SHA256, V2_ANSWER1_SHA256, V2_ANSWER0_SHA256)
    assert bytes(x ^ y for x, y in zip(a0, a1)) == vector_pages()[42].tobytes()
    if accept == BIN:
        assert response["X-Morpho-Epoch-Id"] == str(VECTOR_EPOCH["epoch_id"])


@pytest.mark.parametrize("accept", [None, BIN])
@pytest.mark.parametrize("encoding", ["json", "binary"])
def test_a_v2_batch_recovers_every_target(api, encoding, accept):
    targets = [0, 42, 127, 128, 199, 5, 77, 150, 3]  # 3 queries of 3 keys
    pairs = gen_key_pairs(targets, D, key_format=KEY_FORMAT_V2)
    sides = []
    for party in (0, 1):
        keys = pairs.key_bytes(party)
        if encoding == "json":
            body = {"queries": [{"keys": [k.hex() for k in keys[q:q + 3]]} for q in (0, 3, 6)]}
            sides.append(answers(post_json(api, BATCH, body, accept)))
        else:
            sides.append(answers(post(api, BATCH, b"".join(keys), accept=accept)))
    for target, a, b in zip(targets, *sides):
        assert bytes(x ^ y for x, y in zip(a, b)) == vector_pages()[target].tobytes()


def _errors(response):
    assert response.status_code == 400, response.content
    assert response["Content-Type"] == "application/json"
    return [(e["field"], e["code"], e["message"]) for e in response.json()["errors"]]


def test_json_request_mixing_formats_is_refused_naming_each_key(api):
    v1 = KEY0_HEX
    single = _errors(post_json(api, SINGLE, {"keys": [V2_KEY0_HEX, v1, V2_KEY1_HEX]}))
    assert [(f, c) for f, c, _ in single] == [("keys[1]", "key_format")]
    assert "a v1 key, expected v2" in single[0][2]
    batch = _errors(post_json(api, BATCH, {"queries": [{"keys": [v1] * 3},
                                                       {"keys": [v1, V2_KEY0_HEX, v1]}]}))
    # every key follows the request's first key, within a query and across queries
    assert [(f, c) for f, c, _ in batch] == [("queries[1].keys[1]", "key_format")]
    assert "a v2 key, expected v1" in batch[0][2]
    across = _errors(post_json(api, BATCH, {"queries": [{"keys": [V2_KEY0_HEX] * 3},
                                                        {"keys": [v1] * 3}]}))
    assert [f for f, _, _ in across] == ["queries[1].keys[0]", "queries[1].keys[1]",
                                         "queries[1].keys[2]"]


@pytest.mark.parametrize("path, body, field, code, message", [
    (BATCH, (V2_KEY0 * 3)[:-1], "body", "body_length",
     "expected a multiple of 162 bytes (one query is 3 keys of 54 bytes: a v2 key: "
     "36 + 18 * max(domain_bits 8 - 7, 0)), got 161"),
    (SINGLE, V2_KEY0 * 2, "body", "body_length", "expected 162 bytes"),
    (BATCH, gen_keys(5, 9, key_format=KEY_FORMAT_V2)[0].to_bytes() * 3, "body", "body_length",
     "got 216; the first key's domain_bits byte is 9, this server's epoch has domain_bits 8"),
    (BATCH, with_byte(V2_KEY0, 19, 9) * 3, "queries[0].keys[0]", "key_format",
     "v2 key is 54 bytes but its domain_bits byte says 9, which needs 72 bytes"),
    (BATCH, V2_KEY0 + with_byte(V2_KEY0, 17, 4) + V2_KEY0, "queries[0].keys[1]", "key_format",
     "party byte is 4, expected 0 or 1 (body bytes 54 to 107)"),
    (BATCH, V2_KEY0 + with_byte(V2_KEY0, 20 + 16, 2) + V2_KEY0, "queries[0].keys[1]",
     "key_format", "level 0 t_cw_left byte is 2"),
    # a v1 key's first 54 bytes where a v2 key should be: one format per request
    (BATCH, V2_KEY0 + bytes.fromhex(KEY0_HEX)[:54] + V2_KEY0, "queries[0].keys[1]", "key_format",
     "a v1 key, expected v2"),
])
def test_malformed_v2_binary_bodies_are_named(api, path, body, field, code, message):
    errors = _errors(post(api, path, body, accept=BIN))
    assert (errors[0][0], errors[0][1]) == (field, code)
    assert message in errors[0][2]


def test_a_v2_key_of_another_domain_is_named_as_such(api):
    other = gen_keys(3, 12, key_format=KEY_FORMAT_V2)[0].to_bytes().hex()  # 126 bytes, d = 12
    errors = _errors(post_json(api, SINGLE, {"keys": [V2_KEY0_HEX, other, V2_KEY0_HEX]}))
    assert errors[0][:2] == ("keys[1]", "domain_bits")
    assert "expected 8 (this server's epoch), got 12 (a v2 key of 126 bytes)" in errors[0][2]
    short = _errors(post_json(api, SINGLE, {"keys": [V2_KEY0_HEX[:-2]] * 3}))
    assert short[0][:2] == ("keys[0]", "key_length")
    assert "expected 54 bytes (a v2 key: 36 + 18 * max(domain_bits 8 - 7, 0)), got 53" in short[0][2]


@pytest.fixture
def bulk(serve_matrix, vector_matrix_path, settings):
    serve_matrix(vector_matrix_path)
    user = User.objects.create_user("bob", password="pw")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.mark.django_db
def test_bulk_jobs_refuse_v2_keys_in_both_encodings(bulk):
    body = {"queries": [{"keys": [KEY0_HEX] * 3}, {"keys": [V2_KEY0_HEX] * 3}]}
    errors = _errors(bulk.generic("POST", "/bulk/jobs", json.dumps(body), content_type="application/json"))
    assert errors[0][:2] == ("queries[1].keys[0]", "key_format")
    assert "bulk jobs take v1 keys only" in errors[0][2]
    errors = _errors(bulk.generic("POST", "/bulk/jobs", V2_KEY0 * 3, content_type=BIN))
    assert errors[0][:2] == ("body", "key_format")


def test_an_engine_that_takes_v1_keys_only_is_advertised_and_guarded_as_such(api, monkeypatch):
    # a RemoteEngine whose wire carries v1 keys only sets no key_formats (key_formats_of): the
    # web tier then advertises v1 alone and refuses v2 keys with a 400, never a 500
    from gpu_engine.engine import Engine

    monkeypatch.setattr(Engine, "key_formats", (1,))
    assert api.get("/epoch").json()["key_formats"] == ["v1"]
    errors = _errors(post_json(api, SINGLE, {"keys": [V2_KEY0_HEX] * 3}))
    assert errors[0][:2] == ("keys[0]", "key_format") and "a v2 key, expected v1" in errors[0][2]
    errors = _errors(post(api, BATCH, V2_KEY0 * 3, accept=BIN))
    assert errors[0][:2] == ("body", "key_format")
    monkeypatch.delattr(Engine, "key_formats")
    assert api.get("/epoch").json()["key_formats"] == ["v1"]


@pytest.mark.django_db
def test_an_engine_of_v2_keys_alone_is_advertised_so_and_refuses_v1_and_bulk_jobs(bulk, monkeypatch):
    # a backend that answers v2 keys alone (key_formats (2,); none of today's), so the
    # engine does; /epoch says so, v1 keys get a 400 naming the key, and bulk jobs (v1 keys) are
    # refused up front
    from gpu_engine.backends.cpu import NumpyBackend

    monkeypatch.setattr(NumpyBackend, "key_formats", (2,))
    assert bulk.get("/epoch").json()["key_formats"] == ["v2"]
    errors = _errors(post_json(bulk, SINGLE, {"keys": [KEY0_HEX] * 3}))
    assert errors[0][:2] == ("keys[0]", "key_format") and "a v1 key, expected v2" in errors[0][2]
    body = {"queries": [{"keys": [KEY0_HEX] * 3}]}
    errors = _errors(bulk.generic("POST", "/bulk/jobs", json.dumps(body), content_type="application/json"))
    assert errors[0][:2] == ("queries", "key_format") and "answers v2 keys only" in errors[0][2]
    errors = _errors(bulk.generic("POST", "/bulk/jobs", bytes.fromhex(KEY0_HEX) * 3, content_type=BIN))
    assert errors[0][:2] == ("queries", "key_format")

"""The HTTP API against docs/PROTOCOL.md: exact answers, field-named 400s, 413, 503, Retry-After."""
from __future__ import annotations

import hashlib
import json

import pytest
from rest_framework.test import APIClient

from morpho_pir.dpf import gen_keys, key_length
from engine.holder import get_engine
from tests.conftest import VECTOR_EPOCH
from tests.protocol_vectors import (
    ANSWER0_PREFIX,
    ANSWER0_SHA256,
    ANSWER1_SHA256,
    KEY0_HEX,
    KEY1_HEX,
    vector_pages,
)

SINGLE = "/query/page/gpu"
BATCH = "/query/page/gpu/batch"
D = 8  # the vector matrix has 200 pages: domain_bits 8
KEY_LEN = key_length(D)


@pytest.fixture
def api(serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    return APIClient()


def post(api, path, body, **extra):
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return api.generic("POST", path, raw, content_type=extra.pop("content_type", "application/json"),
                       **extra)


def page_bytes(hex_text: str) -> bytes:
    assert hex_text.startswith("0x") and hex_text == hex_text.lower()
    return bytes.fromhex(hex_text[2:])


def sha(hex_text: str) -> str:
    return hashlib.sha256(page_bytes(hex_text)).hexdigest()


def with_byte(hex_key: str, offset: int, value: int) -> str:
    raw = bytearray.fromhex(hex_key)
    raw[offset] = value
    return raw.hex()


# --- the happy paths ------------------------------------------------------------------------------


def test_health_reports_epoch_backend_and_queue(api):
    response = api.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["epoch_id"] == VECTOR_EPOCH["epoch_id"]
    assert body["block_number"] == VECTOR_EPOCH["block_number"]
    assert body["backend"] == "cpu"
    assert body["fallback_reason"] is None  # cpu was asked for, nothing fell back
    assert body["pass_queries"] == 74  # queries a launch holds at most: the CPU's one pass, the static bound
    # which matrix layout, and why: the CPU backend has one
    assert body["layout"] == "pages"
    assert body["layout_reason"] == "this backend scans pages, its one layout"
    assert body["queue_depth"] == {"interactive": 0, "bulk": 0}
    assert body["num_pages"] == 200 and body["domain_bits"] == D


def test_epoch_is_the_protocol_shape(api):
    response = api.get("/epoch")
    assert response.status_code == 200
    assert response.json() == {
        "epoch_id": 5,
        "num_rows": 3200,
        "seeds": [1, 2, 3**40],
        "block_number": 1234,
        "state_root": "0x" + bytes(range(32)).hex(),
        "page_pir": {"domain_bits": 8, "rows_per_page": 16, "num_pages": 200,
                     "page_size_bytes": 4096},
        "encodings": ["json", "binary"],
        "key_formats": ["v1", "v2"],
        # no row written over the epoch's file yet: zero updates, the zero digest
        "state": {"epoch_id": 5, "updates": 0, "digest": "0x" + "00" * 32},
    }


def test_single_query_answers_match_the_vectors(api):
    # Party 0's key bare, party 1's key 0x-prefixed and upper-case: both spellings are accepted.
    response = post(api, SINGLE, {"keys": [KEY0_HEX, "0x" + KEY1_HEX.upper(), KEY0_HEX]})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["epoch_id"] == VECTOR_EPOCH["epoch_id"]
    a0, a1, a2 = body["pages"]
    assert sha(a0) == ANSWER0_SHA256 and sha(a2) == ANSWER0_SHA256
    assert sha(a1) == ANSWER1_SHA256
    assert a0.startswith("0x" + ANSWER0_PREFIX)
    page42 = bytes(x ^ y for x, y in zip(page_bytes(a0), page_bytes(a1)))
    assert page42 == vector_pages()[42].tobytes()


def test_batch_answers_in_request_order(api):
    queries = [{"keys": [KEY0_HEX] * 3}, {"keys": [KEY1_HEX, KEY0_HEX, KEY1_HEX]}]
    response = post(api, BATCH, {"queries": queries})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["epoch_id"] == VECTOR_EPOCH["epoch_id"]
    assert [[sha(p) for p in r["pages"]] for r in body["results"]] == [
        [ANSWER0_SHA256] * 3,
        [ANSWER1_SHA256, ANSWER0_SHA256, ANSWER1_SHA256],
    ]


def test_full_batch_of_32_recovers_each_target_page(api):
    rows = [(37 * i + 5) % 200 for i in range(32)]
    keys_a, keys_b = [], []
    for target in rows:
        k0, k1 = gen_keys(target, D)
        keys_a.append({"keys": [k0.to_bytes().hex()] * 3})
        keys_b.append({"keys": [k1.to_bytes().hex()] * 3})
    ra, rb = post(api, BATCH, {"queries": keys_a}), post(api, BATCH, {"queries": keys_b})
    assert ra.status_code == rb.status_code == 200
    pages = vector_pages()
    for target, qa, qb in zip(rows, ra.json()["results"], rb.json()["results"]):
        got = bytes(x ^ y for x, y in zip(page_bytes(qa["pages"][2]), page_bytes(qb["pages"][2])))
        assert got == pages[target].tobytes()


# --- malformed requests: 400 naming the field, the query, the key, expected and got ---------------

GOOD = KEY0_HEX
OTHER_DOMAIN = gen_keys(3, D + 1)[0].to_bytes().hex()


@pytest.mark.parametrize(
    "body, field, query, key, message",
    [
        ('{"keys": [', "body", None, None, "expected a JSON document"),
        (b'\xff\xfe{"keys": []}', "body", None, None, "expected a JSON document"),
        ("[" * 5000 + "]" * 5000, "body", None, None, "expected a JSON document"),
        ([GOOD, GOOD, GOOD], "body", None, None, "expected a JSON object, got array"),
        ({}, "keys", 0, None, "expected an array of 3 hex-encoded DPF keys, got nothing"),
        ({"keys": None}, "keys", 0, None, "got null"),
        ({"keys": GOOD}, "keys", 0, None, "expected an array of keys, got string"),
        ({"keys": [GOOD, GOOD]}, "keys", 0, None, "expected 3 keys, got 2"),
        ({"keys": [GOOD] * 4}, "keys", 0, None, "expected 3 keys, got 4"),
        ({"keys": [GOOD, 12, GOOD]}, "keys[1]", 0, 1, "expected a hex string, got number"),
        ({"keys": [GOOD, GOOD, None]}, "keys[2]", 0, 2, "got null"),
        ({"keys": [GOOD, "zz" + GOOD[2:], GOOD]}, "keys[1]", 0, 1,
         "expected hex digits 0-9a-f, got 'z' at position 0"),
        ({"keys": [GOOD, GOOD[:10] + " " + GOOD[11:], GOOD]}, "keys[1]", 0, 1,
         "got ' ' at position 10"),
        ({"keys": [GOOD + "0", GOOD, GOOD]}, "keys[0]", 0, 0,
         f"expected an even number of hex digits, got {2 * KEY_LEN + 1}"),
        ({"keys": [GOOD, GOOD, GOOD[:-2]]}, "keys[2]", 0, 2,
         f"expected {KEY_LEN} bytes (35 + 18 * domain_bits 8), got {KEY_LEN - 1}"),
        ({"keys": [GOOD, GOOD, GOOD + "00"]}, "keys[2]", 0, 2,
         f"expected {KEY_LEN} bytes (35 + 18 * domain_bits 8), got {KEY_LEN + 1}"),
        ({"keys": [OTHER_DOMAIN, GOOD, GOOD]}, "keys[0]", 0, 0,
         "domain_bits: expected 8 (this server's epoch), got 9"),
        ({"keys": [GOOD, with_byte(GOOD, 17, 2), GOOD]}, "keys[1]", 0, 1,
         "party byte is 2, expected 0 or 1"),
        ({"keys": [with_byte(GOOD, 16, 255), GOOD, GOOD]}, "keys[0]", 0, 0,
         "root_t byte is 255, expected 0 or 1"),
        ({"keys": [GOOD, GOOD, with_byte(GOOD, 19 + 18 * 3 + 16, 7)]}, "keys[2]", 0, 2,
         "level 3 t_cw_left byte is 7, expected 0 or 1"),
        ({"keys": [GOOD, GOOD, with_byte(GOOD, 19 + 18 * 7 + 17, 2)]}, "keys[2]", 0, 2,
         "level 7 t_cw_right byte is 2, expected 0 or 1"),
    ],
)
def test_malformed_single_query_is_a_400_naming_the_field(api, body, field, query, key, message):
    response = post(api, SINGLE, body)
    assert response.status_code == 400, response.content
    assert response["Content-Type"] == "application/json"
    error = response.json()["errors"][0]
    assert (error["field"], error["query"], error["key"]) == (field, query, key)
    assert message in error["message"]
    assert response.json()["detail"].startswith(field + ": ")


def test_batch_errors_name_every_bad_query_and_key(api):
    queries = [
        {"keys": [GOOD] * 3},
        {"keys": [GOOD, GOOD]},
        {"keys": [GOOD, with_byte(GOOD, 17, 9), GOOD]},
        "not a query",
        {"keys": [GOOD, GOOD, GOOD[:-1]]},
    ]
    response = post(api, BATCH, {"queries": queries})
    assert response.status_code == 400
    errors = {(e["field"], e["query"], e["key"]): e["message"] for e in response.json()["errors"]}
    assert errors == {
        ("queries[1].keys", 1, None): "expected 3 keys, got 2",
        ("queries[2].keys[1]", 2, 1): "party byte is 9, expected 0 or 1",
        ("queries[3]", 3, None): "expected a JSON object, got string",
        ("queries[4].keys[2]", 4, 2): f"expected an even number of hex digits, got {2 * KEY_LEN - 1}",
    }


@pytest.mark.parametrize(
    "body, message",
    [
        ({"queries": []}, "expected 1 to 32 queries, got 0"),
        ({"queries": [{"keys": [GOOD] * 3}] * 33}, "expected 1 to 32 queries, got 33"),
        ({"queries": {"keys": [GOOD] * 3}}, "expected an array of queries, got object"),
        ({"keys": [GOOD] * 3}, "expected an array of queries, got nothing"),
    ],
)
def test_batch_size_is_checked(api, body, message):
    response = post(api, BATCH, body)
    assert response.status_code == 400
    (error,) = response.json()["errors"]
    assert (error["field"], error["query"], error["key"], error["message"]) == (
        "queries", None, None, message)


def test_batch_cap_follows_the_setting(api, settings):
    settings.MORPHO_MAX_BATCH = 4
    assert post(api, BATCH, {"queries": [{"keys": [GOOD] * 3}] * 4}).status_code == 200
    response = post(api, BATCH, {"queries": [{"keys": [GOOD] * 3}] * 5})
    assert response.status_code == 400
    assert response.json()["errors"][0]["message"] == "expected 1 to 4 queries, got 5"


def test_body_over_the_limit_is_a_413(api, settings):
    settings.MORPHO_MAX_BODY_BYTES = 4096
    body = json.dumps({"queries": [{"keys": [GOOD] * 3}] * 8})
    response = post(api, BATCH, body)
    assert response.status_code == 413
    assert response.json()["errors"] == [{
        "field": "body", "query": None, "key": None, "code": "too_large",
        "message": f"expected at most 4096 bytes (MORPHO_MAX_BODY_BYTES), got {len(body)}",
    }]
    # The same limit lets a smaller request through.
    assert post(api, SINGLE, {"keys": [GOOD] * 3}).status_code == 200


def test_wrong_content_type_and_method_are_json_4xx(api):
    response = post(api, SINGLE, "keys=1", content_type="application/x-www-form-urlencoded")
    assert response.status_code == 415
    assert response.json()["errors"][0]["field"] == "Content-Type"
    assert ("expected application/json or application/octet-stream, got "
            "application/x-www-form-urlencoded") in response.json()["detail"]
    response = api.get(SINGLE)
    assert response.status_code == 405 and "GET" in response.json()["detail"]
    response = api.get("/no/such/endpoint")
    assert response.status_code == 404 and response.json() == {"detail": "no endpoint at /no/such/endpoint"}


# --- the service cannot answer: 503 with a JSON reason and Retry-After ---------------------------


def test_stopped_engine_answers_503_with_retry_after(api):
    assert api.get("/health").status_code == 200
    get_engine().stop()  # the real engine, refusing work as it does while stopped
    response = post(api, SINGLE, {"keys": [GOOD] * 3})
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response.json() == {"detail": "engine is not running"}
    response = post(api, BATCH, {"queries": [{"keys": [GOOD] * 3}]})
    assert response.status_code == 503 and response["Retry-After"] == "5"
    health = api.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert health["Retry-After"]


def test_missing_matrix_answers_503_naming_the_file(serve_matrix, tmp_path, settings):
    missing = tmp_path / "nowhere.bin"
    serve_matrix(missing, MORPHO_ENGINE_RETRY_AFTER=7)
    api = APIClient()
    for response in (api.get("/health"), api.get("/epoch"), post(api, SINGLE, {"keys": [GOOD] * 3})):
        assert response.status_code == 503
        assert response["Retry-After"] == "7"
        assert str(missing) in response.json()["detail"]
        assert "make_matrix" in response.json()["detail"]


def test_answer_not_ready_in_time_is_a_503(api, settings):
    settings.MORPHO_QUERY_TIMEOUT = 1e-6
    response = post(api, SINGLE, {"keys": [GOOD] * 3})
    assert response.status_code == 503
    assert response.json() == {"detail": "no answer from the engine within 1e-06 s"}
    assert response["Retry-After"] == "1"
    # The engine is unharmed: the next request, with time to wait, is answered.
    settings.MORPHO_QUERY_TIMEOUT = 60
    response = post(api, SINGLE, {"keys": [GOOD] * 3})
    assert response.status_code == 200 and sha(response.json()["pages"][0]) == ANSWER0_SHA256


def test_keys_the_engine_refuses_after_validation_are_a_503_not_a_500(api, monkeypatch):
    # An engine server that switched epochs refuses keys that this web process checked against
    # the epoch it still knows (a RemoteEngine learns the switch with its next answer): the client
    # is told to read /epoch again, whatever this process's copy of the epoch says.
    engine = get_engine()

    def refuse(keys, counts):
        raise ValueError("keys of domain_bits 3 for an epoch of domain_bits 20")

    monkeypatch.setattr(engine, "submit_keys", refuse)
    response = post(api, SINGLE, {"keys": [GOOD] * 3})
    assert response.status_code == 503 and response["Retry-After"] == "1"
    assert response.json() == {"detail": "the epoch changed while the request was validated"}


def test_malformed_content_length_is_a_400(api):
    response = post(api, SINGLE, {"keys": [GOOD] * 3}, CONTENT_LENGTH="12x")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {"field": "Content-Length", "query": None, "key": None, "code": "content_length",
         "message": "expected a non-negative integer, got '12x'"}]


def test_chunked_body_without_length_is_a_411(api):
    response = post(api, SINGLE, {"keys": [GOOD] * 3}, CONTENT_LENGTH="",
                    HTTP_TRANSFER_ENCODING="chunked")
    assert response.status_code == 411
    assert response.json()["detail"] == "Content-Length: expected a Content-Length header, got a chunked body"

"""The binary encoding beside JSON (docs/PROTOCOL.md section 5.3): identical answers with keys the
client makes, JSON unchanged, and every malformed binary request a JSON 4xx naming what is wrong."""
from __future__ import annotations

import hashlib
import json
import random

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as fuzz_settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from morpho_pir.dpf import gen_keys, key_length
from engine.holder import get_engine
from morpho_client.plan import plan_query
from tests.conftest import VECTOR_EPOCH
from tests.protocol_vectors import ANSWER0_SHA256, ANSWER1_SHA256, KEY0_HEX, KEY1_HEX, vector_pages

SINGLE = "/query/page/gpu"
BATCH = "/query/page/gpu/batch"
BIN = "application/octet-stream"
D = 8  # the vector matrix: 200 pages
KEY_LEN = key_length(D)  # 179
QUERY_LEN = 3 * KEY_LEN  # 537
PAGE = 4096
KEY0, KEY1 = bytes.fromhex(KEY0_HEX), bytes.fromhex(KEY1_HEX)


@pytest.fixture
def api(serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    return APIClient()


def post(api, path, body: bytes, content_type=BIN, accept=None):
    extra = {} if accept is None else {"HTTP_ACCEPT": accept}
    return api.generic("POST", path, body, content_type=content_type, **extra)


def post_json(api, path, body, accept=None):
    return post(api, path, json.dumps(body).encode(), "application/json", accept)


def pages_of(response) -> list[list[bytes]]:
    """Each query's three answers, whichever encoding the response is in."""
    assert response.status_code == 200, response.content
    if response["Content-Type"] == BIN:
        raw = response.content
        assert len(raw) % (3 * PAGE) == 0
        assert int(response["X-Morpho-Queries"]) == len(raw) // (3 * PAGE)
        return [[raw[q * 3 * PAGE + k * PAGE:][:PAGE] for k in range(3)]
                for q in range(len(raw) // (3 * PAGE))]
    assert response["Content-Type"] == "application/json"
    body = response.json()
    results = body["results"] if "results" in body else [body]
    return [[bytes.fromhex(page[2:]) for page in result["pages"]] for result in results]


def epoch_of(response) -> int:
    if response["Content-Type"] == BIN:
        return int(response["X-Morpho-Epoch-Id"])
    return response.json()["epoch_id"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- answers -----------------------------------------------------------------------------------


def test_binary_single_query_answers_the_vectors(api):
    response = post(api, SINGLE, KEY0 + KEY1 + KEY0, accept=BIN)
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == BIN
    assert response["X-Morpho-Epoch-Id"] == str(VECTOR_EPOCH["epoch_id"])
    assert response["X-Morpho-Queries"] == "1"
    assert len(response.content) == 3 * PAGE
    a0, a1, a2 = pages_of(response)[0]
    assert [sha(a0), sha(a1), sha(a2)] == [ANSWER0_SHA256, ANSWER1_SHA256, ANSWER0_SHA256]
    assert bytes(x ^ y for x, y in zip(a0, a1)) == vector_pages()[42].tobytes()


@pytest.mark.parametrize("path, queries", [(SINGLE, 1), (BATCH, 1), (BATCH, 7), (BATCH, 32)])
def test_every_combination_of_encodings_gives_identical_bytes(api, path, queries):
    rand = random.Random(queries)
    plans = [plan_query(rand.randrange(200), 200, D) for _ in range(queries)]
    answers = {}
    for party in ("a", "b"):
        keys = [list(getattr(plan, f"keys_{party}")) for plan in plans]
        raw = b"".join(bytes.fromhex(key) for query in keys for key in query)
        body = {"keys": keys[0]} if path == SINGLE else {"queries": [{"keys": q} for q in keys]}
        responses = {
            ("json", "json"): post_json(api, path, body),
            ("json", "binary"): post_json(api, path, body, accept=BIN),
            ("binary", "json"): post(api, path, raw),
            ("binary", "binary"): post(api, path, raw, accept=BIN),
        }
        got = {combo: pages_of(response) for combo, response in responses.items()}
        assert {combo: epoch_of(r) for combo, r in responses.items()} == dict.fromkeys(
            responses, VECTOR_EPOCH["epoch_id"])
        assert all(pages == got["json", "json"] for pages in got.values()), "encodings differ"
        assert [combo for combo, r in responses.items() if r["Content-Type"] == BIN] == [
            ("json", "binary"), ("binary", "binary")]
        answers[party] = got["binary", "binary"]
    matrix = vector_pages()
    for plan, half_a, half_b in zip(plans, answers["a"], answers["b"]):
        for slot, page in enumerate(plan.pages):
            page_bytes = bytes(x ^ y for x, y in zip(half_a[slot], half_b[slot]))
            assert page_bytes == matrix[page].tobytes()


def test_json_answers_are_byte_for_byte_the_json_encoding(api):
    # The JSON wire format is unchanged: compact, keys in this order, 0x-prefixed lower-case hex;
    # no Accept, */* and application/json all get it, as does an Accept that lists JSON first.
    single = post(api, SINGLE, KEY0 + KEY1 + KEY0)
    hexes = [f'"0x{page.hex()}"' for page in pages_of(single)[0]]
    expected = ('{"epoch_id":5,"pages":[' + ",".join(hexes) + "]}").encode()
    assert single.content == expected
    for accept in ("*/*", "application/json", f"application/json, {BIN}", "application/*"):
        response = post_json(api, SINGLE, {"keys": [KEY0_HEX, KEY1_HEX, KEY0_HEX]}, accept=accept)
        assert response["Content-Type"] == "application/json" and response.content == expected
    batch = post_json(api, BATCH, {"queries": [{"keys": [KEY0_HEX, KEY1_HEX, KEY0_HEX]}]})
    pages = ",".join(hexes).encode()
    assert batch.content == b'{"epoch_id":5,"results":[{"pages":[' + pages + b"]}]}"


def test_accept_picks_binary_only_when_it_asks_for_it(api):
    body = KEY0 + KEY1 + KEY0
    assert post(api, SINGLE, body, accept=f"{BIN}, application/json;q=0.5")["Content-Type"] == BIN
    assert post(api, SINGLE, body, accept=f"text/plain, {BIN}")["Content-Type"] == BIN
    assert post(api, SINGLE, body, accept=f"application/json;q=0.9, {BIN}")["Content-Type"] == BIN
    assert post(api, SINGLE, body, accept=f"{BIN};q=0.2, */*")["Content-Type"] == "application/json"
    assert post(api, SINGLE, body, accept=f"application/json, {BIN};q=0.3")["Content-Type"] == (
        "application/json")
    nothing = post(api, SINGLE, body, accept=f"*/*;q=0")
    assert nothing.status_code == 406 and nothing["Content-Type"] == "application/json"
    by_format = api.generic("POST", SINGLE + "?format=binary", body, content_type=BIN)
    assert by_format["Content-Type"] == BIN
    assert by_format.content == post(api, SINGLE, body, accept=BIN).content
    refused = post(api, SINGLE, body, accept="text/html")
    assert refused.status_code == 406 and refused["Content-Type"] == "application/json"
    assert "Could not satisfy the request Accept header" in refused.json()["detail"]


def test_epoch_advertises_both_encodings(api):
    assert api.get("/epoch").json()["encodings"] == ["json", "binary"]


# --- malformed binary requests: JSON 4xx naming what is wrong, never a 500 ----------------------


def with_byte(raw: bytes, offset: int, value: int) -> bytes:
    out = bytearray(raw)
    out[offset] = value
    return bytes(out)


GOOD = KEY0 + KEY1 + KEY0
OTHER_DOMAIN = b"".join(gen_keys(3, D + 1)[0].to_bytes() for _ in range(3))  # 3 x 197 bytes
SHAPE = f"3 keys of {KEY_LEN} bytes: 35 + 18 * domain_bits 8"
MULTIPLE = f"a multiple of {QUERY_LEN} bytes (one query is {SHAPE})"
ONE = f"{QUERY_LEN} bytes (one query, {SHAPE})"


@pytest.mark.parametrize(
    "path, body, field, query, key, code, message",
    [
        (BATCH, GOOD + b"\0", "body", None, None, "body_length", f"expected {MULTIPLE}, got 538"),
        (BATCH, GOOD[:-1], "body", None, None, "body_length", f"expected {MULTIPLE}, got 536"),
        (BATCH, GOOD * 2 + GOOD[:1], "body", None, None, "body_length",
         f"expected {MULTIPLE}, got {2 * QUERY_LEN + 1}"),
        (BATCH, b"", "queries", None, None, "count", "expected 1 to 32 queries, got 0"),
        (BATCH, GOOD * 33, "queries", None, None, "count", "expected 1 to 32 queries, got 33"),
        (SINGLE, b"", "body", None, None, "body_length", f"expected {ONE}, got 0"),
        (SINGLE, GOOD * 2, "body", None, None, "body_length",
         f"expected {ONE}, got {2 * QUERY_LEN}"),
        (SINGLE, GOOD[:-1], "body", None, None, "body_length", f"expected {ONE}, got 536"),
        (BATCH, OTHER_DOMAIN, "body", None, None, "body_length",
         f"expected {MULTIPLE}, got 591; the first key's domain_bits byte is 9, this server's "
         "epoch has domain_bits 8"),
        # The third key of the first query says domain_bits 9: the one key check of both encodings.
        (BATCH, with_byte(GOOD, 2 * KEY_LEN + 18, 9), "queries[0].keys[2]", 0, 2, "key_format",
         f"key is {KEY_LEN} bytes but its domain_bits byte says 9, which needs 197 bytes "
         f"(body bytes {2 * KEY_LEN} to {QUERY_LEN - 1})"),
        (SINGLE, with_byte(GOOD, 2 * KEY_LEN + 18, 9), "keys[2]", 0, 2, "key_format",
         "domain_bits byte says 9"),
        (BATCH, GOOD * 3 + with_byte(GOOD, KEY_LEN + 17, 2), "queries[3].keys[1]", 3, 1,
         "key_format", f"party byte is 2, expected 0 or 1 (body bytes {3 * QUERY_LEN + KEY_LEN} "
         f"to {3 * QUERY_LEN + 2 * KEY_LEN - 1})"),
        (BATCH, with_byte(GOOD, 18, 0), "queries[0].keys[0]", 0, 0, "key_format",
         "domain_bits byte is 0, expected 1..32"),
        (BATCH, with_byte(GOOD, 16, 7), "queries[0].keys[0]", 0, 0, "key_format",
         "root_t byte is 7, expected 0 or 1"),
        (BATCH, with_byte(GOOD, 19 + 18 * 5 + 17, 3), "queries[0].keys[0]", 0, 0, "key_format",
         "level 5 t_cw_right byte is 3, expected 0 or 1"),
        (BATCH, b'{"queries": [{"keys": ["00", "00", "00"]}]}', "body", None, None, "body_length",
         f"expected {MULTIPLE}, got 43"),
    ],
)
@pytest.mark.parametrize("accept", [None, BIN])
def test_malformed_binary_is_a_json_400_naming_what_is_wrong(api, path, body, field, query, key,
                                                              code, message, accept):
    response = post(api, path, body, accept=accept)
    assert response.status_code == 400, response.content
    assert response["Content-Type"] == "application/json"
    errors = response.json()["errors"]
    assert (errors[0]["field"], errors[0]["query"], errors[0]["key"], errors[0]["code"]) == (
        field, query, key, code)
    assert message in errors[0]["message"]
    assert response.json()["detail"] == f"{field}: {errors[0]['message']}"


def test_every_bad_key_of_a_binary_batch_is_named(api):
    twice_bad = with_byte(with_byte(GOOD, 16, 2), 2 * KEY_LEN + 16, 3)
    body = GOOD + with_byte(GOOD, 17, 9) + GOOD + twice_bad
    errors = post(api, BATCH, body, accept=BIN).json()["errors"]
    assert [(e["field"], e["code"]) for e in errors] == [
        ("queries[1].keys[0]", "key_format"), ("queries[3].keys[0]", "key_format"),
        ("queries[3].keys[2]", "key_format")]


def test_binary_and_json_bodies_name_a_bad_key_with_the_same_code_and_reason(api):
    bad = with_byte(GOOD, KEY_LEN + 17, 5)
    binary = post(api, BATCH, bad).json()["errors"]
    hexed = post_json(api, BATCH, {"queries": [{"keys": [bad[i * KEY_LEN:][:KEY_LEN].hex()
                                                         for i in range(3)]}]}).json()["errors"]
    assert [(e["field"], e["code"]) for e in binary] == [(e["field"], e["code"]) for e in hexed]
    assert binary[0]["message"].startswith(hexed[0]["message"] + " (body bytes")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/octet", "multipart/form-data; boundary=x"])
def test_wrong_content_type_is_a_415_naming_both_encodings(api, content_type):
    response = post(api, BATCH, GOOD, content_type=content_type, accept=BIN)
    assert response.status_code == 415 and response["Content-Type"] == "application/json"
    assert response.json()["detail"] == (
        f"Content-Type: expected application/json or application/octet-stream, got {content_type}")


def test_binary_body_over_the_limit_is_a_413(api, settings):
    settings.MORPHO_MAX_BODY_BYTES = 4 * QUERY_LEN
    response = post(api, BATCH, GOOD * 5, accept=BIN)
    assert response.status_code == 413 and response["Content-Type"] == "application/json"
    assert post(api, BATCH, GOOD * 4, accept=BIN).status_code == 200


def test_binary_request_to_a_stopped_engine_is_a_json_503(api):
    assert api.get("/health").status_code == 200
    get_engine().stop()
    response = post(api, BATCH, GOOD, accept=BIN)
    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"detail": "engine is not running"}


def test_binary_parity_with_json_under_a_smaller_batch_cap(api, settings):
    settings.MORPHO_MAX_BATCH = 2
    assert post(api, BATCH, GOOD * 2, accept=BIN).status_code == 200
    response = post(api, BATCH, GOOD * 3, accept=BIN)
    assert response.json()["errors"][0]["message"] == "expected 1 to 2 queries, got 3"


# --- fuzz: valid binary bodies with random edits are answered 200 or refused 4xx, never 500 ----

@given(
    queries=st.integers(min_value=0, max_value=34),
    edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=4),
    cut=st.integers(min_value=-3, max_value=3),
    path=st.sampled_from([SINGLE, BATCH]),
    accept=st.sampled_from([None, BIN, "application/json", f"{BIN};q=0.5, */*", "text/csv"]),
)
@fuzz_settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_edited_binary_bodies_never_give_a_500(api, queries, edits, cut, path, accept):
    body = bytearray(GOOD * queries)
    for offset, value in edits:
        if body:
            body[offset % len(body)] = value
    body = bytes(body[:len(body) + cut] if cut < 0 else body + b"\x01" * cut)
    response = post(api, path, body, accept=accept)
    assert response.status_code in (200, 400, 406), response.content
    if response.status_code != 200 or accept in (None, "application/json", f"{BIN};q=0.5, */*"):
        assert response["Content-Type"] == "application/json"
    else:
        assert response["Content-Type"] == BIN
        assert len(response.content) == int(response["X-Morpho-Queries"]) * 3 * PAGE


def test_the_schema_describes_both_encodings(api):
    schema = api.get("/api/schema?format=json").json()
    for path in (SINGLE, BATCH):
        operation = schema["paths"][path]["post"]
        assert set(operation["requestBody"]["content"]) == {"application/json", BIN}
        assert operation["requestBody"]["content"][BIN]["schema"]["format"] == "binary"
        ok = operation["responses"]["200"]
        assert set(ok["content"]) == {"application/json", BIN}
        assert set(ok["headers"]) == {"X-Morpho-Epoch-Id", "X-Morpho-Queries", "X-Morpho-State-Updates",
                                      "X-Morpho-State-Digest"}
        # Errors are JSON only, whatever the client asked for.
        assert set(operation["responses"]["400"]["content"]) == {"application/json"}
    assert BIN in schema["paths"]["/bulk/jobs"]["post"]["requestBody"]["content"]
    results = schema["paths"]["/bulk/jobs/{id}/results"]["get"]["responses"]["200"]
    assert BIN in results["content"] and "X-Morpho-Epoch-Ranges" in results["headers"]
    epoch = schema["components"]["schemas"]["EpochInfo"]
    assert "encodings" in epoch["required"]

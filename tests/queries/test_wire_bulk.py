"""Bulk jobs in the binary encoding: raw key upload, raw results with their epochs in headers, and
the same per-query validation and errors as the JSON body."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import DpfKey, KeyBatch, gen_keys, key_length
from gpu_engine.matrix import load_matrix
from engine.holder import get_engine
from queries import bulk, bulk_files
from queries.bulk_runner import answer_queries, parse_chunk
from queries.models import BulkChunk, BulkJob

pytestmark = pytest.mark.django_db
JOBS = "/bulk/jobs"
BIN = "application/octet-stream"
D = 8  # the vector matrix: 200 pages
KEY_LEN = key_length(D)
QUERY_LEN = 3 * KEY_LEN


@pytest.fixture
def client(serve_matrix, vector_matrix_path, settings):
    serve_matrix(vector_matrix_path)
    settings.MORPHO_BULK_CHUNK = 4
    user = User.objects.create_user("bob", password="pw")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return api


def make_queries(n: int, seed: int = 0) -> list[list[bytes]]:
    rng = np.random.default_rng(seed)
    return [[gen_keys(int(rng.integers(200)), D, rng=rng)[int(rng.integers(2))].to_bytes()
             for _ in range(3)] for _ in range(n)]


def submit_binary(api, raw: bytes, **extra):
    return api.generic("POST", JOBS, raw, content_type=BIN, **extra)


def submit_json(api, queries):
    body = {"queries": [{"keys": [key.hex() for key in query]} for query in queries]}
    return api.generic("POST", JOBS, json.dumps(body), content_type="application/json")


def answer_all(job_id, epochs=None):
    """What the workers do, in-process; `epochs` relabels chunk i's answers as epochs[i]."""
    chunks = BulkChunk.objects.filter(job_id=job_id).order_by("index")
    for index, chunk_id in enumerate(chunks.values_list("pk", flat=True)):
        chunk = bulk.claim_chunk(chunk_id, "w@h")
        epoch_id, answers, state = answer_queries(get_engine(), parse_chunk(chunk), lambda: None, 1.0)
        if epochs:
            epoch_id, state = epochs[index], dataclasses.replace(state, epoch_id=epochs[index])
        assert bulk.store_answers(chunk, "w@h", epoch_id, answers, state)


def test_binary_upload_makes_the_same_job_as_json(client):
    queries = make_queries(10)
    binary = submit_binary(client, b"".join(b"".join(q) for q in queries))
    hexed = submit_json(client, queries)
    assert binary.status_code == hexed.status_code == 201, binary.content
    assert binary.json()["total"] == hexed.json()["total"] == 10
    assert binary.json()["chunk_size"] == hexed.json()["chunk_size"]
    stored = [[bulk_files.read_keys(c.keys_file)
               for c in BulkChunk.objects.filter(job_id=r.json()["id"]).order_by("index")]
              for r in (binary, hexed)]
    assert stored[0] == stored[1] and b"".join(stored[0]) == b"".join(b"".join(q) for q in queries)


def test_binary_results_match_ndjson_and_the_reference(client, vector_matrix_path):
    queries = make_queries(10, seed=4)
    job_id = submit_binary(client, b"".join(b"".join(q) for q in queries)).json()["id"]
    early = client.get(f"{JOBS}/{job_id}/results", HTTP_ACCEPT=BIN)
    assert early.status_code == 409 and early["Content-Type"] == "application/json"
    assert "queued" in early.json()["detail"]
    answer_all(job_id, epochs=[5, 5, 6])  # chunks of 4, 4 and 2 queries
    response = client.get(f"{JOBS}/{job_id}/results", HTTP_ACCEPT=BIN)
    assert response.status_code == 200 and response["Content-Type"] == BIN
    assert response.streaming
    raw = b"".join(response.streaming_content)
    assert response["X-Morpho-Queries"] == response["X-Bulk-Total"] == "10"
    assert response["X-Morpho-Epoch-Ids"] == "5,6"
    assert response["X-Morpho-Epoch-Ranges"] == "0-7=5,8-9=6"
    zero = "0x" + "00" * 32  # no row written: the served state of each chunk
    assert response["X-Morpho-State-Ranges"] == f"0-7=5:0:{zero},8-9=6:0:{zero}"
    keys = [DpfKey.from_bytes(key) for query in queries for key in query]
    expected = reference_answers(load_matrix(vector_matrix_path), KeyBatch.from_keys(keys))
    assert raw == b"".join(row.tobytes() for row in expected)
    lines = client.get(f"{JOBS}/{job_id}/results", HTTP_ACCEPT="application/x-ndjson")
    parsed = [json.loads(line) for line in b"".join(lines.streaming_content).splitlines()]
    assert [line["epoch_id"] for line in parsed] == [5] * 8 + [6] * 2
    assert [line["state"] for line in parsed] == (
        [{"epoch_id": 5, "updates": 0, "digest": zero}] * 8
        + [{"epoch_id": 6, "updates": 0, "digest": zero}] * 2)
    assert b"".join(bytes.fromhex(p[2:]) for line in parsed for p in line["pages"]) == raw


def test_job_details_are_json_only(client):
    job_id = submit_binary(client, b"".join(b"".join(q) for q in make_queries(2))).json()["id"]
    response = client.get(f"{JOBS}/{job_id}", HTTP_ACCEPT=BIN)
    assert response.status_code == 406 and response["Content-Type"] == "application/json"


def bad_byte(raw: bytes, offset: int, value: int) -> bytes:
    out = bytearray(raw)
    out[offset] = value
    return bytes(out)


GOOD = b"".join(b"".join(q) for q in make_queries(6, seed=9))


@pytest.mark.parametrize(
    "raw, errors",
    [
        (GOOD + b"\0", [("body", None, None, "body_length",
                        f"expected a multiple of {QUERY_LEN} bytes (one query is 3 keys of "
                        f"{KEY_LEN} bytes: 35 + 18 * domain_bits 8), got {len(GOOD) + 1}")]),
        (b"", [("queries", None, None, "count",
                "expected 1 to 100000 queries (MORPHO_BULK_MAX_QUERIES), got 0")]),
        (bad_byte(bad_byte(GOOD, 4 * QUERY_LEN + 2 * KEY_LEN + 18, 9), QUERY_LEN + 17, 3), [
            ("queries[1].keys[0]", 1, 0, "key_format", "party byte is 3, expected 0 or 1 "
             f"(body bytes {QUERY_LEN} to {QUERY_LEN + KEY_LEN - 1})"),
            ("queries[4].keys[2]", 4, 2, "key_format",
             "key is 179 bytes but its domain_bits byte says 9, which needs 197 bytes "
             f"(body bytes {4 * QUERY_LEN + 2 * KEY_LEN} to {5 * QUERY_LEN - 1})"),
        ]),
    ],
)
def test_a_bad_binary_upload_is_rejected_whole_naming_each_problem(client, raw, errors):
    response = submit_binary(client, raw)
    assert response.status_code == 400 and response["Content-Type"] == "application/json"
    got = [(e["field"], e["query"], e["key"], e["code"], e["message"])
           for e in response.json()["errors"]]
    assert got == errors
    assert not BulkJob.objects.exists()


def test_binary_upload_counts_against_the_query_limit(client, settings):
    settings.MORPHO_BULK_MAX_QUERIES = 5
    response = submit_binary(client, GOOD)
    assert response.status_code == 400
    assert response.json()["errors"][0]["message"] == (
        "expected 1 to 5 queries (MORPHO_BULK_MAX_QUERIES), got 6")


def test_a_large_binary_upload_is_stored_as_sent(client, settings):
    settings.MORPHO_BULK_CHUNK = 1024
    raw = GOOD * 1000  # 6,000 queries, 3.2 MB: more than Django's default 2.5 MB body limit
    response = submit_binary(client, raw)
    assert response.status_code == 201, response.content[:300]
    assert response.json()["total"] == 6000
    chunks = BulkChunk.objects.filter(job_id=response.json()["id"]).order_by("index")
    assert [c.count for c in chunks] == [1024] * 5 + [880]
    assert b"".join(bulk_files.read_keys(c.keys_file) for c in chunks) == raw

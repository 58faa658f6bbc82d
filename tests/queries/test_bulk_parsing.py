"""Bulk bodies read as streams (JSON and NDJSON), the spool of validated queries, and the per-user
rate, quota and per-process reading slots of bulk submissions."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from django.contrib.auth.models import User
from rest_framework import exceptions
from rest_framework.test import APIClient

import queries.api.bulk_parsing as bulk_parsing
import queries.api.bulk_serializers as bulk_serializers
from morpho_pir.dpf import gen_keys
from queries.api.bulk_limits import slots
from queries.api.bulk_parsing import QuerySpool, StreamingBulkJSONParser, ndjson_lines
from queries import bulk_files
from queries.models import BulkJob

JOBS = "/bulk/jobs"
D = 8  # the vector matrix: 200 pages


def parse(body: bytes):
    """What the streaming parser hands the serializer, with the query array read out."""
    data = StreamingBulkJSONParser().parse(io.BytesIO(body))
    if isinstance(data, dict) and not isinstance(data.get("queries", []), (list, str, int)):
        queries = [item for _, item in data["queries"]]
        return {**data, "queries": queries}
    return data


@pytest.fixture(params=[7, 64 * 1024], ids=["7-byte reads", "64-KiB reads"])
def read_bytes(request, monkeypatch):
    # Tiny reads put every value, number, escape and UTF-8 sequence across a read boundary.
    monkeypatch.setattr(bulk_parsing, "READ_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("document", [
    {"queries": [{"keys": ["0x12", "ab"]}, {"keys": []}, 17, -2.5e3, None, True, "x"]},
    [{"keys": ["é€😀", "\\u00e9 \" \\\\"]}, [], {}, 123456789012345678901234567890],
    {"before": [1, {"a": "b"}], "queries": [{"keys": [1]}], "after": {"c": [None]}},
    {"queries": []},
    [],
    {"no queries": 1},
    {},
    {"queries": "everything"},
])
def test_streamed_json_reads_what_json_loads_reads(read_bytes, document):
    expected = document if isinstance(document, dict) else {"queries": document}
    for text in (json.dumps(document), json.dumps(document, indent=3),
                 json.dumps(document, separators=(",", ":"), ensure_ascii=False)):
        assert parse(text.encode()) == expected


@pytest.mark.parametrize("body, message", [
    (b"", "the body is empty"),
    (b"   ", "the body is empty"),
    (b'{"queries": [1, 2', "expected ',' or ']' after query 1"),
    (b'{"queries": [1, "2', "Unterminated string starting at character 16"),
    (b'{"queries": [1, 2] , ', "expected a member name in double quotes"),
    (b'{"queries": [1 2]}', "expected ',' or ']' after query 0"),
    (b'{"queries": [1, 2]', "expected ',' or '}' after a member"),
    (b'{"queries": [1, 2]} x', "unexpected data after the JSON document"),
    (b"[1, 2] [3]", "unexpected data after the JSON document"),
    (b'{"queries": [1, }' + b" " * 100_000, "Expecting value at character 16"),
    (b'{"queries": [1, -]', "Expecting value at character 16"),
    (b'{queries: []}', "expected a member name in double quotes"),
    (b'{"a" 1}', "expected ':' after a member name"),
    (b'{"queries": [], "queries": [1]}', '"queries" given twice'),
    (b'[' + b'[' * 5000 + b']' * 5000 + b']', "nested too deeply"),
    (b'["\xff\xfe"]', "body is not UTF-8"),
])
def test_broken_json_is_a_parse_error_naming_the_place(read_bytes, body, message):
    with pytest.raises(exceptions.ParseError, match=message):
        parse(body)


def test_a_query_larger_than_the_cap_is_refused_without_reading_it_whole(read_bytes, settings):
    settings.MORPHO_BULK_MAX_QUERY_BYTES = 1024
    body = b'[{"keys": []}, {"keys": ["' + b"a" * 10_000 + b'"]}]'
    with pytest.raises(exceptions.ValidationError) as caught:
        parse(body)
    assert "expected at most 1024 characters of JSON per query" in str(caught.value.detail[1])
    with pytest.raises(exceptions.ParseError, match="outside \"queries\" is larger than 1024"):
        parse(b'{"pad": "' + b"b" * 5000 + b'", "queries": []}')


def test_ndjson_lines_longer_than_the_cap_are_skipped_and_counted(read_bytes):
    body = b'{"a": 1}\n' + b"x" * 5000 + b"\n\n" + b'{"b": 2}\n' + b"y" * 300 + b'{"c": 3}'
    got = list(ndjson_lines(io.BytesIO(body), cap=100))
    assert got == [(1, b'{"a": 1}\n'), (2, None), (3, b"\n"), (4, b'{"b": 2}\n'), (5, None)]
    assert list(ndjson_lines(io.BytesIO(b"no newline"), cap=100)) == [(1, b"no newline")]


def test_the_spool_moves_to_disk_and_gives_queries_back_in_order(monkeypatch):
    monkeypatch.setattr(bulk_parsing, "SPOOL_MEMORY_BYTES", 1000)
    spool = QuerySpool()
    records = [bytes([i % 256]) * 99 for i in range(50)]
    for record in records:
        spool.append(record)
    assert spool._file._rolled  # past 1000 bytes the queries live in a temporary file
    assert len(spool) == 50 and list(spool) == records
    with pytest.raises(ValueError, match="query of 3 key bytes in a spool of 99"):
        spool.append(b"abc")
    spool.close()


# --- through the API ---------------------------------------------------------------------------


@pytest.fixture
def client(db, serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    api = APIClient()
    api.force_authenticate(User.objects.create_user("bob"))
    return api


def good_queries(n: int) -> list[dict]:
    rng = np.random.default_rng(3)
    keys = [k.to_bytes().hex() for p in (1, 2) for k in gen_keys(p, D, rng=rng)]
    return [{"keys": [keys[i % 4], keys[(i + 1) % 4], keys[(i + 2) % 4]]} for i in range(n)]


def post(api, body):
    return api.generic("POST", JOBS, json.dumps(body), content_type="application/json")


def test_reading_stops_at_the_thousandth_bad_query(client):
    response = post(client, [[]] * 5000 + good_queries(1))
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert len(errors) == 1001 and errors[999]["query"] == 999
    assert errors[-1]["message"] == ("reading stopped at query 999: 1000 queries are invalid, "
                                     "and the rest were not checked")
    assert not BulkJob.objects.exists()


def test_a_large_job_is_spooled_and_stored_whole(client, settings, monkeypatch):
    monkeypatch.setattr(bulk_parsing, "SPOOL_MEMORY_BYTES", 4096)
    settings.MORPHO_BULK_CHUNK = 64
    response = post(client, {"queries": good_queries(300)})
    assert response.status_code == 201, response.json()
    job = BulkJob.objects.get()
    chunks = list(job.chunks.order_by("index"))
    assert job.total == 300 and [c.count for c in chunks] == [64, 64, 64, 64, 44]
    first = bytes.fromhex("".join(good_queries(1)[0]["keys"]))
    assert bulk_files.read_keys(chunks[0].keys_file)[: len(first)] == first


def test_valid_json_queries_are_checked_at_once_and_a_bad_one_is_named(client, monkeypatch):
    # 600 queries are checked in three vectorised passes: the field-by-field check (about 50 µs a
    # query, as much as the engine's share at 65,536 pages) runs only where a pass fails, and
    # names the bad query as the batch endpoint would.
    checked = []
    real = bulk_serializers.PageQuerySerializer

    def counted(*args, **kwargs):
        checked.append(kwargs.get("data"))
        return real(*args, **kwargs)

    monkeypatch.setattr(bulk_serializers, "PageQuerySerializer", counted)
    assert post(client, good_queries(600)).status_code == 201
    assert checked == []
    queries = good_queries(600)
    queries[300]["keys"][1] = queries[300]["keys"][1][:-2]
    response = post(client, queries)
    assert response.status_code == 400
    (error,) = response.json()["errors"]
    assert error["query"] == 300 and error["field"] == "queries[300].keys[1]", error
    assert len(checked) == bulk_serializers.CHECK_AT_ONCE  # only the pass that failed, key by key


def test_submissions_are_limited_per_user(client, settings):
    settings.MORPHO_BULK_SUBMIT_THROTTLE = "2/hour"
    statuses = [post(client, good_queries(1)).status_code for _ in range(3)]
    assert statuses == [201, 201, 429]
    refused = post(client, good_queries(1))
    assert int(refused["Retry-After"]) >= 1 and "throttled" in refused.json()["detail"].lower()
    other = APIClient()
    other.force_authenticate(User.objects.create_user("carol"))
    assert post(other, good_queries(1)).status_code == 201  # another user has their own count
    assert client.get(JOBS).status_code == 200  # reading is not a submission


def test_a_user_may_have_only_so_many_jobs_in_flight(client, settings):
    settings.MORPHO_BULK_MAX_ACTIVE_JOBS = 2
    assert [post(client, good_queries(1)).status_code for _ in range(2)] == [201, 201]
    refused = post(client, good_queries(1))
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert refused.json()["detail"].startswith(
        "2 of your bulk jobs are queued or running, expected fewer than 2 "
        "(MORPHO_BULK_MAX_ACTIVE_JOBS)")
    client.delete(f"{JOBS}/{BulkJob.objects.first().pk}")
    assert post(client, good_queries(1)).status_code == 201


def test_only_a_few_bodies_are_read_at_once_per_process(client, settings):
    settings.MORPHO_BULK_PARSE_SLOTS = 1
    with slots.reading():
        busy = post(client, good_queries(1))
    assert busy.status_code == 503 and int(busy["Retry-After"]) >= 1
    assert "(MORPHO_BULK_PARSE_SLOTS=1); retry shortly" in busy.json()["detail"]
    assert post(client, good_queries(1)).status_code == 201
    assert slots.busy == 0


def test_a_large_form_field_is_refused_in_json(client, settings):
    upload = io.BytesIO(b"{}\n")
    upload.name = "q.ndjson"
    pad = "z" * (settings.MORPHO_MAX_BODY_BYTES + 1)
    response = client.post(JOBS, {"file": upload, "pad": pad}, format="multipart")
    assert response.status_code == 400
    assert response.json()["detail"].startswith("body: expected a smaller form body")

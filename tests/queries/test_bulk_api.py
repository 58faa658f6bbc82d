"""Bulk job API in-process: auth, per-query validation, limits, content types, cancel, results."""

from __future__ import annotations

import io
import json
import uuid

import numpy as np
import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import DpfKey, KeyBatch, gen_keys
from gpu_engine.matrix import load_matrix
from engine.holder import get_engine
from queries import bulk, bulk_files
from gpu_engine.scheduler import LanePolicy
from queries.bulk_runner import answer_queries, parse_chunk, request_plan
from queries.models import BulkChunk, BulkJob, BulkResult, JobStatus
from tests.protocol_vectors import KEY0_HEX, KEY1_HEX

pytestmark = pytest.mark.django_db
JOBS = "/bulk/jobs"
D = 8  # the vector matrix: 200 pages


@pytest.fixture
def key_pool():
    rng = np.random.default_rng(7)
    keys = [DpfKey.from_bytes(bytes.fromhex(KEY0_HEX)), DpfKey.from_bytes(bytes.fromhex(KEY1_HEX))]
    for _ in range(4):
        keys += list(gen_keys(int(rng.integers(200)), D, rng=rng))
    return keys


def queries_of(pool, n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"keys": [pool[int(i)].to_bytes().hex() for i in rng.integers(len(pool), size=3)]}
        for _ in range(n)
    ]


@pytest.fixture
def client(serve_matrix, vector_matrix_path, settings):
    serve_matrix(vector_matrix_path)
    settings.MORPHO_BULK_CHUNK = 4
    user = User.objects.create_user("alice", password="pw")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    api.user = user
    return api


def post_json(api, body, **extra):
    return api.generic("POST", JOBS, json.dumps(body), content_type="application/json", **extra)


def ndjson(queries) -> bytes:
    return "".join(json.dumps(q) + "\n" for q in queries).encode()


# --- submitting ------------------------------------------------------------------------------


def test_anonymous_users_get_401(serve_matrix, vector_matrix_path, key_pool):
    serve_matrix(vector_matrix_path)
    anonymous = APIClient()
    response = post_json(anonymous, {"queries": queries_of(key_pool, 2)})
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"
    assert anonymous.get(f"{JOBS}/{uuid.uuid4()}").status_code == 401
    assert BulkJob.objects.count() == 0


def test_bulk_bodies_have_their_own_size_limit(client, key_pool, settings):
    body = {"queries": queries_of(key_pool, 300)}
    assert len(json.dumps(body)) > settings.MORPHO_MAX_BODY_BYTES  # too big for a query endpoint
    response = post_json(client, body)
    assert response.status_code == 201, response.json()
    assert response.json()["total"] == 300
    settings.MORPHO_BULK_MAX_BODY_BYTES = 100_000
    response = post_json(client, body)
    assert response.status_code == 413
    assert "expected at most 100000 bytes (MORPHO_BULK_MAX_BODY_BYTES)" in response.json()["detail"]


def test_json_job_is_split_into_policy_sized_chunks(client, key_pool):
    response = post_json(client, {"queries": queries_of(key_pool, 10)})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "queued" and body["total"] == 10 and body["answered"] == 0
    assert response["Location"].endswith(f"/bulk/jobs/{body['id']}")
    chunks = list(BulkChunk.objects.filter(job_id=body["id"]).order_by("index"))
    assert [(c.index, c.first, c.count) for c in chunks] == [(0, 0, 4), (1, 4, 4), (2, 8, 2)]
    assert body["chunks"]["queued"] == 3
    # The stored keys are the submitted ones, in order.
    first = queries_of(key_pool, 10)[4]["keys"]
    assert bulk_files.read_keys(chunks[1].keys_file)[: 3 * len(bytes.fromhex(first[0]))].hex() == "".join(first)


def test_bare_array_ndjson_body_and_uploaded_file_make_the_same_job(client, key_pool):
    queries = queries_of(key_pool, 6)
    bare = post_json(client, queries)
    body = client.generic(
        "POST", JOBS, ndjson(queries) + b"\n", content_type="application/x-ndjson"
    )
    upload = io.BytesIO(ndjson(queries))
    upload.name = "queries.ndjson"
    form = client.post(JOBS, {"file": upload}, format="multipart")
    for response in (bare, body, form):
        assert response.status_code == 201, response.json()
        assert response.json()["total"] == 6
    stored = {bulk_files.read_keys(c.keys_file) for c in BulkChunk.objects.filter(index=0)}
    assert len(stored) == 1  # three jobs, identical first chunks


def test_a_job_with_bad_queries_is_rejected_whole_naming_each(client, key_pool):
    queries = queries_of(key_pool, 6)
    queries[1]["keys"][2] = "zz" + queries[1]["keys"][2][2:]
    queries[3]["keys"] = queries[3]["keys"][:2]
    queries[5] = ["not", "an", "object"]
    response = post_json(client, {"queries": queries})
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert [(e["query"], e["key"], e["code"]) for e in errors] == [
        (1, 2, "not_hex"),
        (3, None, "count"),
        (5, None, "invalid"),
    ]
    assert errors[0]["field"] == "queries[1].keys[2]"
    assert "expected 3 keys, got 2" in errors[1]["message"]
    assert BulkJob.objects.count() == 0 and BulkChunk.objects.count() == 0


def test_malformed_ndjson_lines_are_named(client, key_pool):
    lines = ndjson(queries_of(key_pool, 3)).split(b"\n")
    lines[1] = b'{"keys": ['
    response = client.generic("POST", JOBS, b"\n".join(lines), content_type="application/x-ndjson")
    assert response.status_code == 400
    (error,) = response.json()["errors"]
    assert error["query"] == 1 and error["code"] == "parse_error"
    assert error["message"].startswith("line 2: expected a JSON object, got invalid JSON")
    # The same file uploaded: the same answer.
    upload = io.BytesIO(b"\n".join(lines))
    upload.name = "broken.ndjson"
    response = client.post(JOBS, {"file": upload}, format="multipart")
    assert response.status_code == 400 and response.json()["errors"] == [error]
    upload = io.BytesIO(b"\xff\xfe not utf-8 \x00\n")
    upload.name = "binary.ndjson"
    response = client.post(JOBS, {"file": upload}, format="multipart")
    assert response.status_code == 400
    assert response.json()["errors"][0]["message"].startswith("line 1: expected a JSON object")
    assert BulkJob.objects.count() == 0


@pytest.mark.parametrize("kind", ["json", "ndjson"])
def test_over_the_limit_and_empty_are_400(client, key_pool, settings, kind):
    settings.MORPHO_BULK_MAX_QUERIES = 5

    def send(queries):
        if kind == "json":
            return post_json(client, {"queries": queries})
        return client.generic("POST", JOBS, ndjson(queries), content_type="application/x-ndjson")

    over = send(queries_of(key_pool, 6))
    assert over.status_code == 400
    assert over.json()["errors"][0]["field"] == "queries"
    assert over.json()["errors"][0]["message"].startswith(
        "expected 1 to 5 queries (MORPHO_BULK_MAX_QUERIES)"
    )
    empty = send([])
    # An empty NDJSON body never reaches the parser: DRF sees no data at all.
    assert empty.status_code == 400
    assert empty.json()["errors"][0]["message"].endswith(
        "got 0" if kind == "json" else "got nothing"
    )
    assert send(queries_of(key_pool, 5)).status_code == 201


def test_wrong_content_type_and_missing_file(client, key_pool):
    response = client.generic(
        "POST", JOBS, ndjson(queries_of(key_pool, 2)), content_type="text/plain"
    )
    assert response.status_code == 415
    assert (
        "application/x-ndjson" in response.json()["detail"]
        and "got text/plain" in response.json()["detail"]
    )
    response = client.post(JOBS, {"other": "x"}, format="multipart")
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "file"
    assert post_json(client, {"queries": "everything"}).json()["errors"][0]["code"] == "not_a_list"


# --- reading, cancelling ---------------------------------------------------------------------


def test_unknown_and_foreign_jobs_are_404(client, key_pool):
    assert client.get(f"{JOBS}/{uuid.uuid4()}").status_code == 404
    assert client.get(f"{JOBS}/not-a-uuid").status_code == 404
    assert client.delete(f"{JOBS}/{uuid.uuid4()}").status_code == 404
    job_id = post_json(client, {"queries": queries_of(key_pool, 2)}).json()["id"]
    bob = APIClient()
    bob.force_authenticate(User.objects.create_user("bob"))
    response = bob.get(f"{JOBS}/{job_id}")
    assert response.status_code == 404 and "detail" in response.json()
    assert [j["id"] for j in client.get(JOBS).json()["results"]] == [job_id]


def test_cancel_a_queued_job_then_cancel_again_is_409(client, key_pool):
    job_id = post_json(client, {"queries": queries_of(key_pool, 9)}).json()["id"]
    response = client.delete(f"{JOBS}/{job_id}")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    assert response.json()["finished"] is not None
    assert set(BulkChunk.objects.filter(job_id=job_id).values_list("status", flat=True)) == {
        "cancelled"
    }
    again = client.delete(f"{JOBS}/{job_id}")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    # A cancelled job's chunk is never claimed, even if its task arrives.
    assert bulk.claim_chunk(BulkChunk.objects.filter(job_id=job_id).first().pk, "w@h") is None


def run_all_chunks(job_id, worker="w@h"):
    """What the worker's task does, in-process: claim, answer on the bulk lane, store once."""
    for chunk_id in (
        BulkChunk.objects.filter(job_id=job_id).order_by("index").values_list("pk", flat=True)
    ):
        chunk = bulk.claim_chunk(chunk_id, worker)
        epoch_id, answers, state = answer_queries(get_engine(), parse_chunk(chunk), lambda: None, 1.0)
        assert bulk.store_answers(chunk, worker, epoch_id, answers, state)


def test_results_stream_in_order_match_the_reference_and_never_duplicate(
    client, key_pool, vector_matrix_path
):
    queries = queries_of(key_pool, 10, seed=3)
    job_id = post_json(client, {"queries": queries}).json()["id"]
    early = client.get(f"{JOBS}/{job_id}/results")
    assert early.status_code == 409 and "queued" in early.json()["detail"]
    run_all_chunks(job_id)
    # A redelivered task for a stored chunk: nothing is written twice, nothing counted twice.
    chunk = BulkChunk.objects.get(job_id=job_id, index=0)
    assert bulk.claim_chunk(chunk.pk, "other@h") is None
    assert bulk.store_answers(chunk, "other@h", 5, bytes(chunk.count * 3 * 4096)) is False
    job = client.get(f"{JOBS}/{job_id}").json()
    assert job["status"] == "done" and job["answered"] == 10 and job["epoch_ids"] == [5]
    assert BulkResult.objects.filter(job_id=job_id).count() == 3

    response = client.get(f"{JOBS}/{job_id}/results", HTTP_ACCEPT="application/x-ndjson")
    assert response.status_code == 200 and response["Content-Type"] == "application/x-ndjson"
    assert response.streaming
    lines = [json.loads(line) for line in b"".join(response.streaming_content).splitlines()]
    assert [line["index"] for line in lines] == list(range(10))
    keys = [DpfKey.from_bytes(bytes.fromhex(k)) for q in queries for k in q["keys"]]
    expected = reference_answers(load_matrix(vector_matrix_path), KeyBatch.from_keys(keys))
    got = [bytes.fromhex(page[2:]) for line in lines for page in line["pages"]]
    assert got == [row.tobytes() for row in expected]
    assert client.delete(f"{JOBS}/{job_id}").status_code == 409  # a done job cannot be cancelled


def test_failed_chunk_fails_the_job_with_its_reason(client, key_pool):
    job_id = post_json(client, {"queries": queries_of(key_pool, 9)}).json()["id"]
    chunk = BulkChunk.objects.get(job_id=job_id, index=1)
    bulk.fail_chunk(chunk.pk, "the job's keys have domain_bits 8, this worker's epoch 2 has 9")
    job = client.get(f"{JOBS}/{job_id}").json()
    assert job["status"] == "failed"
    assert job["errors"][0]["message"].startswith("chunk 1 (queries 4..7): the job's keys")
    assert job["errors"][1]["chunk"] == 1 and job["errors"][1]["queries"] == [4, 7]
    assert job["chunks"] == {"queued": 0, "running": 0, "done": 0, "failed": 1, "cancelled": 2}


def test_admin_lists_progress_and_cancels(client, key_pool):
    job_id = post_json(client, {"queries": queries_of(key_pool, 5)}).json()["id"]
    staff = User.objects.create_superuser("op", password="pw")
    admin = APIClient()
    admin.force_login(staff)
    page = admin.get("/admin/queries/bulkjob/")
    assert page.status_code == 200 and b"<progress" in page.content and b"0 / 5" in page.content
    response = admin.post(
        "/admin/queries/bulkjob/", {"action": "cancel_jobs", "_selected_action": [job_id]}
    )
    assert response.status_code == 302
    assert BulkJob.objects.get(pk=job_id).status == JobStatus.CANCELLED
    assert admin.get(f"/admin/queries/bulkjob/{job_id}/change/").status_code == 200


class _CappedEngine:
    """What request_plan asks of an engine: the bulk policy and the launch cap."""

    def __init__(self, cap: int, max_batch: int = 32) -> None:
        self.cap, self.max_batch = cap, max_batch

    def policies(self):
        return {"bulk": LanePolicy(max_batch=self.max_batch)}

    def launch_cap(self, lane: str) -> int:
        return self.cap


@pytest.mark.parametrize("cap, max_batch, plan", [
    (32, 32, (32, 2)),  # no yield: requests of a full launch, two in flight
    (9, 32, (8, 8)),  # launches of at most 9: requests of 8, 4 to a full launch alone
    (12, 24, (12, 4)),
    (1, 32, (1, 64)),
    (40, 32, (32, 2)),  # never past max_batch
    (10, 7, (7, 2)),
    (42, 42, (21, 4)),  # a launch of 42 merges two requests: one may hold 32 queries at most
    (42, 41, (20, 4)),  # 41 is prime: requests of 20 fill 40 of a launch
    (8, 31, (7, 8)),  # launches of at most 8 out of 31: requests of 7, 4 to 28 of a launch
])
def test_bulk_requests_are_sized_by_the_engines_launch_cap(cap, max_batch, plan):
    assert request_plan(_CappedEngine(cap, max_batch)) == plan

"""State a user sees: the served epoch recorded, 15 minutes of
dashboard history kept server-side, bulk progress launch by launch, a cancelled job's answers."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection, transaction
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import InfoMetricFamily
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from epochs.models import Epoch, EpochState
from epochs.sync import record_served_epoch
from gpu_engine.matrix import read_epoch_metadata
from engine import dashboard
from engine.holder import get_engine, shutdown_engine
from policies.source import live_policies
from policies.models import BatchingPolicy
from queries import bulk
from queries.bulk_runner import answer_queries, parse_chunk
from queries.models import BulkChunk
from queries.bulk_runner import progress_writer
from tests.conftest import VECTOR_EPOCH
from tests.queries.test_bulk_api import key_pool, queries_of  # noqa: F401 - a fixture and a helper

pytestmark = pytest.mark.django_db
JOBS = "/bulk/jobs"


@pytest.fixture
def operator(db):
    user = User.objects.create_user("operator", password="pw")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="epochs"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


# --- the served epoch is a record like any other ------------------------------------------------


def test_the_epoch_a_fresh_party_serves_is_listed(serve_matrix, vector_matrix_path, operator):
    assert not Epoch.objects.exists()
    serve_matrix(vector_matrix_path)
    get_engine()
    listed = operator.get("/api/epochs/").json()
    assert listed["count"] == 1
    record = listed["results"][0]
    assert record["epoch_id"] == VECTOR_EPOCH["epoch_id"] and record["state"] == "active"
    assert record["block_number"] == VECTOR_EPOCH["block_number"]
    assert record["seeds"] == list(VECTOR_EPOCH["seeds"])
    assert record["state_root"] == "0x" + VECTOR_EPOCH["state_root"].hex()
    assert record["num_pages"] == 200 and record["matrix_path"] == os.path.abspath(vector_matrix_path)
    # the file's size and digest as the engine checked them at load, which every later load checks
    sidecar = read_epoch_metadata(vector_matrix_path)
    assert record["size_bytes"] == os.path.getsize(vector_matrix_path) == sidecar["size_bytes"]
    assert record["sha256"] == sidecar["sha256"] and len(record["sha256"]) == 64
    # Another start of the engine (another process of the party) records nothing twice.
    shutdown_engine()
    get_engine()
    assert record_served_epoch(get_engine()) is None
    assert Epoch.objects.count() == 1


def test_an_active_record_is_served_not_overwritten(serve_matrix, vector_matrix_path):
    from gpu_engine.matrix import write_epoch_metadata, write_matrix_file

    # beside the served file: epochs come from the matrix directory (MORPHO_MATRIX_DIR)
    other = write_matrix_file(Path(vector_matrix_path).with_name("state-visible-e9.bin"), 64, seed=9)
    write_epoch_metadata(other, epoch_id=9)
    Epoch.objects.create(epoch_id=9, matrix_path=str(other), num_pages=64, state=EpochState.ACTIVE)
    serve_matrix(vector_matrix_path)
    assert get_engine().epoch.epoch_id == 9  # the database's epoch, not the file's
    assert list(Epoch.objects.values_list("epoch_id", flat=True)) == [9]


# --- the dashboard's history lives in the server -------------------------------------------------


def registry_with_latency():
    registry = CollectorRegistry()
    latency = Histogram("pir_query_duration_seconds", "test", ["endpoint"], registry=registry,
                        buckets=(0.001, 0.01, 0.1, 1.0))

    class Policies:
        def collect(self):
            info = InfoMetricFamily("pir_batching_policy", "test", labels=["lane"])
            info.add_metric(["interactive"], {"name": "x", "mode": "slo", "p95_target_ms": "5"})
            yield info

    registry.register(Policies())
    return registry, latency.labels("single")


def test_history_keeps_per_second_points_for_its_span_and_serves_those_after_a_time():
    registry, latency = registry_with_latency()
    history = dashboard.History(registry, seconds=3)
    for value in (0.0005,) * 20:
        latency.observe(value)
    first = history.sample(now=100.0)
    assert first["p95"] <= 0.001 and first["target"] == 0.005
    for value in (0.05,) * 20:  # the next second is slow: p95 above the 5 ms target
        latency.observe(value)
    second = history.sample(now=101.0)
    assert 0.01 < second["p95"] <= 0.1 and second["p95"] > second["target"]
    assert history.sample(now=102.0)["p95"] is None  # nothing answered in that second
    history.sample(now=103.0)
    assert [p["t"] for p in history.since()] == [101.0, 102.0, 103.0]  # 3 seconds kept
    assert [p["t"] for p in history.since(102.0)] == [103.0]
    assert dashboard.HISTORY_SECONDS == 15 * 60


def test_the_history_thread_holds_no_transaction_between_samples():
    """A collector that leaves its thread's connection in a transaction (autocommit off, a
    table read): after the sample, that connection is closed, so no lock outlives the second."""
    if connection.vendor == "sqlite":  # CI's PostgreSQL pass runs it
        pytest.skip("the tests' in-memory SQLite ignores a close, which would drop the database")
    registry, _ = registry_with_latency()

    class Reads:
        def collect(self):
            transaction.set_autocommit(False)
            Epoch.objects.count()
            seen["open"] = connection.connection is not None and not connection.get_autocommit()
            return []

    registry.register(Reads())
    history, seen = dashboard.History(registry), {}

    def run():
        history.tick()
        seen["closed"] = connection.connection is None

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert seen == {"open": True, "closed": True}
    assert len(history.since()) == 1


def test_page_carries_the_whole_history_and_the_data_endpoint_what_is_new(client, monkeypatch):
    registry, latency = registry_with_latency()
    history = dashboard.History(registry)
    monkeypatch.setattr(dashboard, "_history", history)
    monkeypatch.setattr(history, "start", lambda: None)  # points come from this test only
    for t in (10.0, 11.0, 12.0):
        latency.observe(0.002)
        history.sample(now=t)
    User.objects.create_superuser("root", password="pw")
    client.login(username="root", password="pw")
    page = client.get("/dashboard/").content.decode()
    embedded = json.loads(page.split('id="initial-snapshot" type="application/json">')[1]
                          .split("</script>")[0])
    assert [p["t"] for p in embedded["history"]] == [10.0, 11.0, 12.0]
    assert embedded["history_seconds"] == 900
    assert [p["t"] for p in client.get("/dashboard/data?since=11").json()["history"]] == [12.0]
    bad = client.get("/dashboard/data?since=soon")
    assert bad.status_code == 400 and bad.json()["errors"][0]["field"] == "since"


# --- bulk progress launch by launch; a cancelled job's answers ------------------------------------


@pytest.fixture
def small_launches(serve_matrix, vector_matrix_path, settings):
    """Bulk launches of 2 queries and chunks of 8, on the vector matrix."""
    serve_matrix(vector_matrix_path)
    settings.MORPHO_BULK_CHUNK = 8
    policy = BatchingPolicy.objects.filter(name="bulk-throughput")
    before = policy.get().max_batch
    policy.update(max_batch=2)
    engine = get_engine()
    live_policies().apply()
    assert engine.policies()["bulk"].max_batch == 2
    user = User.objects.create_user("alice", password="pw")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    yield api
    # This process's policy snapshot outlives the test's transaction: put the lane back.
    policy.update(max_batch=before)
    live_policies().apply()


def test_progress_moves_launch_by_launch_within_a_chunk(small_launches, key_pool):
    api = small_launches
    job_id = api.post(JOBS, {"queries": queries_of(key_pool, 8)}, format="json").json()["id"]
    chunk = bulk.claim_chunk(BulkChunk.objects.get(job_id=job_id).pk, "w@h")
    seen = []
    answer_queries(get_engine(), parse_chunk(chunk), lambda: None, 1.0, progress=seen.append)
    assert seen[-1] == 8 and len(seen) >= 2, seen  # per launch of 2, not once per chunk of 8
    assert all(n % 2 == 0 for n in seen) and seen == sorted(set(seen))
    # What the worker stores as it goes shows in the job before the chunk's answers are stored.
    progress_writer(chunk, "w@h")(6)
    job = api.get(f"{JOBS}/{job_id}").json()
    assert job["progress"] == {"answered": 6, "total": 8, "fraction": 0.75}
    assert job["answered"] == 0  # stored answers: none yet


def test_a_cancelled_job_serves_what_was_answered_marked_partial(small_launches, key_pool):
    api = small_launches
    job_id = api.post(JOBS, {"queries": queries_of(key_pool, 20)}, format="json").json()["id"]
    first = bulk.claim_chunk(BulkChunk.objects.get(job_id=job_id, index=0).pk, "w@h")
    running = api.get(f"{JOBS}/{job_id}/results")
    assert running.status_code == 409 and "running" in running.json()["detail"]
    epoch_id, answers, state = answer_queries(get_engine(), parse_chunk(first), lambda: None, 1.0)
    assert bulk.store_answers(first, "w@h", epoch_id, answers, state)
    assert api.delete(f"{JOBS}/{job_id}").status_code == 200
    response = api.get(f"{JOBS}/{job_id}/results")
    assert response.status_code == 200
    assert (response["X-Bulk-Partial"], response["X-Bulk-Answered"], response["X-Bulk-Total"]) == (
        "true", "8", "20")
    lines = [json.loads(line) for line in b"".join(response.streaming_content).splitlines()]
    assert [line["index"] for line in lines] == list(range(8))
    assert all(len(line["pages"]) == 3 for line in lines)

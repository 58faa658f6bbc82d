"""Bulk keys and answers live in files through the storage API; jobs expire and are purged."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from queries import bulk, bulk_files
from queries.models import BulkChunk, BulkJob, BulkResult, JobStatus

pytestmark = pytest.mark.django_db
KEY = 8  # bytes per fake key: claiming and storing never parse them
ANSWER = 3 * 4096


@pytest.fixture
def owner():
    return User.objects.create_user("alice")


@pytest.fixture
def api(owner):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=owner).key}")
    return client


def answers_of(chunk: BulkChunk) -> bytes:
    """Answers that say which query they answer: query i's three pages filled with byte i."""
    return b"".join(bytes([(chunk.first + q) % 256]) * ANSWER for q in range(chunk.count))


def run_job(owner, queries: int, chunk: int) -> BulkJob:
    job = bulk.create_job(owner, (bytes([q % 256]) * 3 * KEY for q in range(queries)), queries,
                          8, chunk)
    while (claimed := bulk.claim_chunk(0, "w@h")) is not None:
        assert bulk.store_answers(claimed, "w@h", 7, answers_of(claimed))
    job.refresh_from_db()
    return job


def files_of(job) -> list[str]:
    try:
        return sorted(bulk_files.storage().listdir(str(job.pk))[1])
    except FileNotFoundError:
        return []


def test_keys_and_answers_are_files_and_the_database_holds_no_blob(owner):
    job = bulk.create_job(owner, (bytes([q]) * 3 * KEY for q in range(5)), 5, 8, 2)
    chunks = list(BulkChunk.objects.filter(job=job).order_by("index"))
    # each chunk's keys, as submitted, in a file of its own
    assert [bulk_files.read_keys(c.keys_file) for c in chunks] == [
        bytes([0]) * 24 + bytes([1]) * 24, bytes([2]) * 24 + bytes([3]) * 24, bytes([4]) * 24]
    while (claimed := bulk.claim_chunk(0, "w@h")) is not None:
        bulk.store_answers(claimed, "w@h", 7, answers_of(claimed))
    results = list(BulkResult.objects.filter(job=job).order_by("index"))
    assert [bulk_files.storage().size(r.answers_file) for r in results] == [
        2 * ANSWER, 2 * ANSWER, ANSWER]
    # answered chunks keep no keys: their files are gone, and only the answers remain
    assert all(c.keys_file == "" for c in BulkChunk.objects.filter(job=job))
    assert files_of(job) == sorted(r.answers_file.split("/")[1] for r in results)
    # no column of the bulk tables holds keys or answers
    for model in (BulkJob, BulkChunk, BulkResult):
        columns = connection.introspection.get_table_description(
            connection.cursor(), model._meta.db_table)
        types = {c.name: connection.introspection.get_field_type(c.type_code, c) for c in columns}
        assert "BinaryField" not in types.values(), (model, types)


def test_results_stream_from_the_files_in_both_encodings(owner, api):
    job = run_job(owner, 40, 16)
    assert job.status == JobStatus.DONE
    binary = api.get(f"/bulk/jobs/{job.pk}/results", HTTP_ACCEPT="application/octet-stream")
    assert binary.status_code == 200
    body = b"".join(binary.streaming_content)
    assert body == b"".join(bytes([q]) * ANSWER for q in range(40))
    assert binary["X-Morpho-Epoch-Ranges"] == "0-39=7"
    lines = api.get(f"/bulk/jobs/{job.pk}/results")
    parsed = [line for line in b"".join(lines.streaming_content).decode().splitlines()]
    assert len(parsed) == 40
    assert parsed[17].startswith('{"index": 17, "epoch_id": 7, "pages": ["0x1111')


def test_a_second_attempt_at_a_stored_chunk_leaves_no_file_behind(owner):
    job = bulk.create_job(owner, [bytes(3 * KEY)], 1, 8, 1)
    chunk = bulk.claim_chunk(0, "w1@h")
    assert bulk.store_answers(chunk, "w1@h", 7, bytes(ANSWER))
    # a redelivered copy of the same chunk computed it again: its answers are not kept
    assert not bulk.store_answers(chunk, "w2@h", 7, bytes(ANSWER))
    assert len(files_of(job)) == 1
    assert BulkResult.objects.get(job=job).answers_file.endswith(files_of(job)[0])


def test_a_finished_job_says_when_it_expires(owner, api, settings):
    settings.MORPHO_BULK_RETENTION_SECONDS = 3600
    job = bulk.create_job(owner, [bytes(3 * KEY)] * 2, 2, 8, 1)
    assert api.get(f"/bulk/jobs/{job.pk}").json()["expires_at"] is None  # queued: not yet
    job = run_job(owner, 2, 1)
    body = api.get(f"/bulk/jobs/{job.pk}").json()
    assert body["status"] == "done"
    assert job.expires == job.finished + timedelta(seconds=3600)
    assert body["expires_at"] == job.expires.isoformat().replace("+00:00", "Z")
    cancelled = bulk.cancel_job(bulk.create_job(owner, [bytes(3 * KEY)], 1, 8, 1))
    assert cancelled.expires == cancelled.finished + timedelta(seconds=3600)


def test_the_purge_deletes_expired_jobs_with_their_files_and_keeps_the_rest(
    owner, api, django_capture_on_commit_callbacks
):
    old, kept = run_job(owner, 3, 1), run_job(owner, 3, 1)
    running = bulk.create_job(owner, [bytes(3 * KEY)], 1, 8, 1)  # no expiry while it is queued
    BulkJob.objects.filter(pk=old.pk).update(expires=timezone.now() - timedelta(seconds=1))
    assert files_of(old) and files_of(kept)
    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):  # the files go once the rows have
        call_command("purge_bulk_jobs", stdout=out)
    assert out.getvalue().startswith("purged 1 bulk job expired before ")
    assert api.get(f"/bulk/jobs/{old.pk}").status_code == 404
    assert api.get(f"/bulk/jobs/{old.pk}/results").status_code == 404
    assert files_of(old) == []
    assert not (bulk_files.storage().exists(str(old.pk)))
    for job in (kept, running):
        assert api.get(f"/bulk/jobs/{job.pk}").status_code == 200 and files_of(job)
    assert not BulkChunk.objects.filter(job_id=old.pk).exists()


def test_the_celery_beat_schedule_runs_the_purge_on_the_bulk_queue(settings):
    from morphoweb.celery import app
    from queries.tasks import purge_expired_jobs

    entry = app.conf.beat_schedule["purge-expired-bulk-jobs"]
    assert entry["task"] == purge_expired_jobs.name
    assert entry["options"]["queue"] == settings.MORPHO_BULK_QUEUE
    assert entry["schedule"] == settings.MORPHO_BULK_PURGE_SECONDS

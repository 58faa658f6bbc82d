"""Bulk jobs through real processes over the filesystem broker: gunicorn, `bin/gpu-workers`.

Each scenario submits 1,000 queries over HTTP and checks every answer against the NumPy reference;
the fault scenarios SIGKILL the workers or their pool processes in the middle of the job."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
import uuid
from datetime import UTC, datetime

import numpy as np
import pytest

from tests.queries.bulk_stack import (QUERIES, body_of, check_answers, check_results, pool_process,
                                      stack, submit, workload)  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes


def test_filesystem_broker_worker_answers_a_1000_query_job(stack, workload):
    s = stack("filesystem://")
    s.start_workers()
    job_id = submit(s, workload)
    job = check_results(s, job_id, workload)
    assert job["errors"] == [] and job["started"] and job["finished"]
    assert s.chunk_attempts() == [1] * -(-QUERIES // job["chunk_size"])  # nothing was redone


def test_sigkilled_worker_is_replaced_and_the_job_completes_exactly_once(stack, workload):
    s = stack("filesystem://")
    first = s.start_workers()
    job_id = submit(s, workload)
    # Killed in the middle of a chunk, not in the gap between two.
    s.wait(job_id, lambda j: j["answered"] >= 160 and s.running_chunks() == 1)
    s.kill_workers(first)
    killed_at = s.job(job_id)
    assert 0 < killed_at["answered"] < QUERIES and killed_at["status"] == "running"
    s.start_workers()
    check_results(s, job_id, workload)
    # The chunk the dead worker held was claimed again by its successor.
    assert max(s.chunk_attempts()) >= 2, s.logs()



def test_killed_pool_process_is_replaced_and_its_chunk_redelivered(stack, workload):
    s = stack("filesystem://")
    supervisor = s.start_workers()
    job_id = submit(s, workload)
    # Killed in the middle of a chunk. A chunk lasts a fraction of a second, so the process may
    # have stored it and be waiting for its next task by the time the signal lands (a case the
    # worker must survive too); then its successor is killed in a chunk of its own. The kill hit
    # a chunk when that chunk is still running under the same claim: only the pool process
    # stores it, and nothing else touches it until its lease ends.
    for _ in range(20):
        s.wait(job_id, lambda j: j["answered"] >= 160 and s.running_chunks() == 1)
        pid = pool_process(supervisor)
        claim = s.running_claim()
        os.kill(pid, signal.SIGKILL)
        if claim is not None and s.running_claim() == claim:
            break
    else:
        raise AssertionError(f"no kill landed in a chunk\n{s.logs()}")
    check_results(s, job_id, workload)
    assert max(s.chunk_attempts()) >= 2
    # The worker itself lived on (Celery started a new pool process); reject_on_worker_lost put
    # the task back, and the same worker could claim the chunk its dead process held.
    assert supervisor.poll() is None and "gpu-workers: cpu0 exited" not in s.logs()
    assert "exited with 'signal 9 (SIGKILL)'" in (s.tmp / "workers-0.log").read_text(
        errors="replace"
    )


def test_pool_process_killed_while_waiting_for_work_does_not_stop_the_worker(stack, workload):
    """An idle pool process waits for its next task holding the lock of the pipe that brings
    tasks; killed there, it must not leave that lock taken for the process started in its place
    (morphoweb/prefork.py)."""
    s = stack("filesystem://")
    supervisor = s.start_workers()
    log = s.tmp / "workers-0.log"
    deadline = time.monotonic() + 120
    while " ready." not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, s.logs()
        time.sleep(0.1)
    time.sleep(1.0)  # no task has come: the pool process is blocked reading the task pipe
    os.kill(pool_process(supervisor), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "exited with 'signal 9 (SIGKILL)'" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, s.logs()
        time.sleep(0.1)
    job = check_results(s, submit(s, workload), workload)
    assert job["errors"] == [] and supervisor.poll() is None


def test_a_2000_query_job_keeps_its_turn_while_small_jobs_stream_in(stack, workload):
    """One worker, job A of 2,000 queries, and small jobs B submitted so that two are always
    waiting: jobs take chunks in turn, so A waits at most two chunks between its own."""
    s = stack("filesystem://", chunk=64)
    s.start_workers()
    _, picks, answers, _ = workload
    big_picks = np.concatenate([picks, picks])
    big = submit(s, workload, body_of(workload, big_picks))
    small: dict[str, np.ndarray] = {}
    visible: dict[str, datetime] = {}  # when each small job's POST had returned (it was stored)
    waiting: list[str] = []
    deadline = time.monotonic() + 300
    while s.job(big)["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, s.logs()
        waiting = [j for j in waiting if s.job(j)["status"] in ("queued", "running")]
        while len(waiting) < 2:
            rows = picks[8 * len(small) % QUERIES :][:8]
            job_id = submit(s, workload, body_of(workload, rows))
            visible[job_id] = datetime.now(UTC).replace(tzinfo=None)
            small[job_id] = rows
            waiting.append(job_id)
        time.sleep(0.05)
    check_answers(s, big, big_picks, answers)
    for job_id, rows in small.items():
        check_answers(s, job_id, rows, answers)

    with sqlite3.connect(s.db) as db:
        rows = db.execute("select claimed, job_id, attempts from queries_bulkchunk").fetchall()
    assert {row[2] for row in rows} == {1}  # nothing was redone, so `claimed` is each claim
    claims = sorted((datetime.fromisoformat(at), uuid.UUID(job).hex) for at, job, _ in rows)
    big_hex = uuid.UUID(big).hex
    a_claims = [at for at, job in claims if job == big_hex]
    # The stream really ran beside A: many small jobs were claimed between A's first and last.
    during = {job for at, job in claims if a_claims[0] < at < a_claims[-1] and job != big_hex}
    assert len(during) >= 10, len(during)
    # At most three jobs have chunks waiting at once (A and two small ones), so from a job's
    # being stored or claimed to its next claim, at most two other chunks are claimed.
    for job in {job for _, job in claims}:
        own = [at for at, other in claims if other == job]
        starts = own[:-1] if job == big_hex else [visible[str(uuid.UUID(job))], *own[:-1]]
        for start, end in zip(starts, own[len(own) - len(starts) :]):
            between = [other for at, other in claims if start < at < end]
            assert len(between) <= 2, (job, start, end, between)


def test_celery_beat_purges_an_expired_job_and_its_files(stack, workload):
    # bin/gpu-workers starts the party's beat beside its worker; it sends the purge every second
    # here, and a worker deletes what is past its expires_at, rows and files.
    s = stack("filesystem://", MORPHO_BULK_PURGE_SECONDS=1)
    s.start_workers()
    picks = workload[1][:40]
    kept = submit(s, workload, body_of(workload, picks))
    check_answers(s, kept, picks, workload[2])
    expired = submit(s, workload, body_of(workload, picks))
    job = check_answers(s, expired, picks, workload[2])
    assert job["expires_at"] is not None
    folder = s.tmp / "bulk" / expired
    assert [p.name for p in folder.iterdir()], "the answers are files under the state folder"
    with sqlite3.connect(s.db) as db:
        db.execute("update queries_bulkjob set expires = '2000-01-01 00:00:00' where id = ?",
                   (uuid.UUID(expired).hex,))
    deadline = time.monotonic() + 60
    while s.request("GET", f"/bulk/jobs/{expired}")[0] != 404:
        assert time.monotonic() < deadline, s.logs()
        time.sleep(0.2)
    assert not folder.exists()
    assert s.job(kept)["status"] == "done"  # not expired: kept, with its answers
    assert s.request("GET", f"/bulk/jobs/{kept}/results")[0] == 200

"""Bulk jobs through real processes: gunicorn, `bin/gpu-workers`, the filesystem or Redis broker.

Each scenario submits 1,000 queries over HTTP and checks every answer against the NumPy reference;
the fault scenarios SIGKILL the workers or restart Redis in the middle of the job."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.matrix import load_matrix, write_matrix_file
from tests.conftest import REPO, redis_reachable, server_env

pytestmark = pytest.mark.processes

PAGES = 512  # d = 9: about 200 queries/s on 2 cores, so a 1,000-query job runs for seconds
QUERIES = 1000
POOL = 24  # distinct keys; queries pick three each, so 3,000 keys cost 24 key generations


class Stack:
    """A party's database, matrix, web server and GPU workers, wired to one broker."""

    def __init__(self, tmp: Path, start_server, broker: str, chunk: int = 32, **env) -> None:
        self.tmp = tmp
        self.db = tmp / "db.sqlite3"
        self.matrix = tmp / "matrix.bin"
        write_matrix_file(self.matrix, PAGES, seed=11)
        self.env = server_env(**{
            "MORPHO_MATRIX_PATH": self.matrix,
            "MORPHO_ENGINE_BACKEND": "cpu",
            "MORPHO_VAR_DIR": tmp,
            "DATABASE_URL": f"sqlite:///{self.db}",
            "CELERY_BROKER_URL": broker,
            "CELERY_FILESYSTEM_BROKER_DIR": tmp / "broker",
            "MORPHO_MAX_BODY_BYTES": 32 << 20,
            "MORPHO_BULK_CHUNK": chunk,
            "MORPHO_BULK_QUEUE": f"bulk-test-{uuid.uuid4().hex[:8]}",
            "MORPHO_BULK_LEASE_SECONDS": 3,
            "MORPHO_BULK_REQUEUE_SECONDS": 4,
            "MORPHO_BULK_SWEEP_SECONDS": 0.5,
            # no GPU for these workers even where one exists: one cpu0 worker
            "CUDA_VISIBLE_DEVICES": "",
            # these tests submit many jobs as one user: the per-user limits are not under test
            "MORPHO_BULK_SUBMIT_THROTTLE": "off",
            "MORPHO_BULK_MAX_ACTIVE_JOBS": 1000,
            **env,  # a test's own settings win
        })
        self.manage("migrate", "--no-input", "-v0")
        out = self.manage(
            "shell",
            "-v0",
            "-c",
            "from django.contrib.auth.models import User\n"
            "from rest_framework.authtoken.models import Token\n"
            "print('TOKEN=' + Token.objects.create(user=User.objects.create_user('bulk')).key)",
        )
        self.token = next(line for line in out.splitlines() if line.startswith("TOKEN="))[6:]
        self.web = start_server("gunicorn", self.env)
        self.workers: list[subprocess.Popen] = []

    def manage(self, *args: str) -> str:
        done = subprocess.run(  # noqa: PLW1510 - the status is asserted with stderr shown
            [sys.executable, "manage.py", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def start_workers(self) -> subprocess.Popen:
        # Left open for the worker to write to until the test ends.
        log = open(self.tmp / f"workers-{len(self.workers)}.log", "wb")  # noqa: SIM115
        # Its own session, so a SIGKILL of the group takes the supervisor, the worker and its
        # pool child.
        proc = subprocess.Popen(
            [sys.executable, "bin/gpu-workers"],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers.append(proc)
        return proc

    def kill_workers(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        self.web.stop()
        for proc in self.workers:
            if proc.poll() is None:
                proc.terminate()  # the supervisor stops its worker with a warm shutdown
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-3000:] for p in sorted(self.tmp.glob("workers-*.log"))
        )

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 120):
        headers = {"Authorization": f"Token {self.token}", "Content-Type": "application/json"}
        req = urllib.request.Request(self.web.url + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def job(self, job_id: str) -> dict:
        status, body = self.request("GET", f"/bulk/jobs/{job_id}")
        assert status == 200, body
        return json.loads(body)

    def wait(self, job_id: str, until, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            time.sleep(0.05)
        raise AssertionError(f"job never reached the state; last {job}\nworkers:\n{self.logs()}")

    def running_chunks(self) -> int:
        with sqlite3.connect(self.db) as db:
            return db.execute(
                "select count(*) from queries_bulkchunk where status = 'running'"
            ).fetchone()[0]

    def running_claim(self) -> tuple | None:
        """(chunk id, claimed) of the chunk running now, if one is."""
        with sqlite3.connect(self.db) as db:
            return db.execute(
                "select id, claimed from queries_bulkchunk where status = 'running'"
            ).fetchone()

    def chunk_attempts(self) -> list[int]:
        with sqlite3.connect(self.db) as db:
            return [
                row[0] for row in db.execute("select attempts from queries_bulkchunk order by id")
            ]


@pytest.fixture
def stack(tmp_path, start_server):
    stacks = []

    def make(broker: str, **kwargs) -> Stack:
        stacks.append(Stack(tmp_path, start_server, broker, **kwargs))
        return stacks[-1]

    yield make
    for made in stacks:
        made.stop()


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """1,000 queries of three keys from a pool, and the reference answer of each pooled key."""
    rng = np.random.default_rng(2024)
    d = (PAGES - 1).bit_length()
    pool = [k for _ in range(POOL // 2) for k in gen_keys(int(rng.integers(PAGES)), d, rng=rng)]
    picks = rng.integers(POOL, size=(QUERIES, 3))
    path = tmp_path_factory.mktemp("ref") / "m.bin"
    write_matrix_file(path, PAGES, seed=11)
    answers = reference_answers(load_matrix(path), KeyBatch.from_keys(pool))
    pool_hex = [key.to_bytes().hex() for key in pool]
    body = json.dumps({"queries": [{"keys": [pool_hex[i] for i in row]} for row in picks]})
    return body.encode(), picks, answers, pool_hex


def submit(stack: Stack, workload, body: bytes | None = None) -> str:
    status, answer = stack.request("POST", "/bulk/jobs", workload[0] if body is None else body)
    assert status == 201, answer
    return json.loads(answer)["id"]


def body_of(workload, picks) -> bytes:
    """A job's JSON body: one query per row of `picks`, three pooled keys each."""
    pool = workload[3]
    return json.dumps({"queries": [{"keys": [pool[i] for i in row]} for row in picks]}).encode()


def check_answers(stack: Stack, job_id: str, picks, answers) -> dict:
    """Wait for the job to end; it is done with every answer present once, in order, and right."""
    job = stack.wait(job_id, lambda j: j["status"] != "running" and j["status"] != "queued")
    assert job["status"] == "done", (job, stack.logs())
    assert job["answered"] == len(picks) and job["epoch_ids"] == [1]
    status, body = stack.request("GET", f"/bulk/jobs/{job_id}/results")
    assert status == 200
    lines = [json.loads(line) for line in body.splitlines()]
    assert [line["index"] for line in lines] == list(range(len(picks)))  # once each, in order
    for line, row in zip(lines, picks):
        assert line["epoch_id"] == 1
        assert [bytes.fromhex(p[2:]) for p in line["pages"]] == [answers[i].tobytes() for i in row]
    with sqlite3.connect(stack.db) as db:
        stored = db.execute(
            "select count(*), sum(count) from queries_bulkresult where job_id = ?",
            (uuid.UUID(job_id).hex,),
        ).fetchone()
    assert stored == (-(-len(picks) // job["chunk_size"]), len(picks))
    return job


def check_results(stack: Stack, job_id: str, workload) -> dict:
    return check_answers(stack, job_id, workload[1], workload[2])


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


def pool_process(supervisor: subprocess.Popen) -> int:
    """The pool process of the worker that `supervisor` (bin/gpu-workers) started: the child of
    the worker's main process, a dead one not yet reaped left out."""
    main = subprocess.run(
        ["pgrep", "-P", str(supervisor.pid)], check=True, capture_output=True, text=True
    ).stdout.split()
    for pid in subprocess.run(
        ["pgrep", "-P", main[0]], check=True, capture_output=True, text=True
    ).stdout.split():
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return int(pid)
        except OSError:
            continue  # gone meanwhile
    raise AssertionError(f"worker {main[0]} has no live pool process")


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


@pytest.mark.skipif(not redis_reachable(), reason="no Redis on 127.0.0.1:6379")
def test_redis_broker_worker_answers_a_1000_query_job(stack, workload):
    s = stack("redis://127.0.0.1:6379/14")
    s.start_workers()
    check_results(s, submit(s, workload), workload)


def test_redis_restarted_mid_job_the_job_completes(stack, workload, own_redis):
    s = stack(own_redis.url)
    s.start_workers()
    job_id = submit(s, workload)
    s.wait(job_id, lambda j: j["answered"] >= 160)
    own_redis.stop()  # every queued message is gone with it
    time.sleep(1.0)
    own_redis.start()
    check_results(s, job_id, workload)


def test_broker_killed_mid_job_costs_at_most_30_s_of_progress(stack, workload, own_redis):
    # Lost messages are resent only after an hour of no progress: what moves the job again is
    # the workers noticing the broker coming back.
    s = stack(own_redis.url, MORPHO_BULK_REQUEUE_SECONDS=3600, MORPHO_BULK_SWEEP_SECONDS=5)
    s.start_workers()
    job_id = submit(s, workload)
    s.wait(job_id, lambda j: j["answered"] >= 160 and s.running_chunks() == 1)
    own_redis.kill()
    killed_at = s.job(job_id)["answered"]
    time.sleep(1.0)
    own_redis.start()
    restarted = time.monotonic()
    # The chunk computing at the kill may still be stored; a second one needs a message the new
    # broker did not have.
    s.wait(job_id, lambda j: j["answered"] >= killed_at + 2 * 32, timeout=60)
    assert time.monotonic() - restarted <= 30, s.logs()
    assert killed_at < QUERIES
    check_results(s, job_id, workload)
    # A task chains the next chunks without the broker, so the job can finish before the worker's
    # consumer has reconnected: the worker says so once it has, within its reconnect interval.
    said = "connected to the broker again; resending bulk chunks it may have lost"
    deadline = time.monotonic() + 30
    while said not in (log := (s.tmp / "workers-0.log").read_text(errors="replace")):
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.5)


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

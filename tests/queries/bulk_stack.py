"""A party of real processes for the bulk tests: gunicorn, `bin/gpu-workers`, a broker; the workload."""

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
from pathlib import Path

import numpy as np
import pytest

from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.matrix import load_matrix, write_matrix_file
from tests.conftest import REPO, server_env

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

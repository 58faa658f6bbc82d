"""One party as real processes: `manage.py serve_engine`, gunicorn with three workers, bulk workers.

Checks what the engine server is for: one process maps the matrix, queries of every web process
meet in its launches, policy and epoch changes reach every web process within a second, bulk jobs
run through it, and SIGKILL or SIGSTOP of it gives prompt 503s, never a hang, and nothing lost."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file
from benchmarks.stack import Party
from tests.conftest import every_web_process_serves, http_json
from tests.protocol_vectors import ANSWER0_SHA256, ANSWER1_SHA256, KEY0_HEX, KEY1_HEX

pytestmark = pytest.mark.processes

DEADLINE_S = 1.5  # MORPHO_ENGINE_DEADLINE of the party: silence after which clients give up


@pytest.fixture(scope="module")
def party(tmp_path_factory, vector_matrix_path):
    """Three web processes, a bulk worker and the engine server; the test is its supervisor."""
    folder = tmp_path_factory.mktemp("p")  # short: an ipc:// path must fit a Unix socket address
    made = Party(Path(vector_matrix_path), folder, backend="cpu", web_workers=3, threads=4,
                 bulk_workers=True, extra_env=dict(
                     MORPHO_ENGINE_DEADLINE=DEADLINE_S, MORPHO_BULK_CHUNK=32,
                     MORPHO_BULK_LEASE_SECONDS=3, MORPHO_BULK_SWEEP_SECONDS=0.5,
                     MORPHO_BULK_REQUEUE_SECONDS=8, MORPHO_BULK_QUEUE="engine-server-test",
                     MORPHO_LOG_LEVEL="INFO", CUDA_VISIBLE_DEVICES=""))
    yield made
    made.stop()


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def active_policy_name(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("pir_batching_policy_info{") and 'lane="interactive"' in line:
                return line.split('name="', 1)[1].split('"', 1)[0]
    return ""


def activate_policy(party: Party, name: str, **fields) -> None:
    party.manage("shell", "-v0", "-c", (
        "from policies.models import BatchingPolicy\n"
        f"p, _ = BatchingPolicy.objects.update_or_create(name={name!r}, defaults={fields!r})\n"
        "p.activate()\n"))


def test_one_engine_server_answers_every_web_process_byte_for_byte(party):
    status, _, health = http_json(party.url + "/health")
    assert status == 200, health
    assert health["engine_url"] == party.env["MORPHO_ENGINE_URL"] and health["reachable"] is True
    assert health["warming"] is False and health["backend"] == "cpu"
    for _ in range(6):  # several requests, so more than one web process answers
        status, _, body = http_json(party.url + "/query/page/gpu", {"keys": [KEY0_HEX, KEY1_HEX, KEY0_HEX]})
        assert status == 200, body
        digests = [hashlib.sha256(bytes.fromhex(p[2:])).hexdigest() for p in body["pages"]]
        assert digests == [ANSWER0_SHA256, ANSWER1_SHA256, ANSWER0_SHA256]
    # three web processes and the Celery worker's pool processes are the server's clients
    assert http_json(party.url + "/health")[2]["engine_clients"] >= 3


def test_only_the_engine_server_holds_the_matrix(party):
    def touches(pid: int) -> bool:
        """The file is mapped into, or open in, the process."""
        try:
            if str(party.matrix) in Path(f"/proc/{pid}/maps").read_text():
                return True
            fds = Path(f"/proc/{pid}/fd")
            return any(os.readlink(fd) == str(party.matrix) for fd in fds.iterdir())
        except OSError:
            return False

    web, workers = party.pids("web"), party.pids("workers")
    assert len(web) >= 4 and len(workers) >= 2  # gunicorn master + 3 workers; supervisor + Celery
    assert [pid for pid in web + workers if touches(pid)] == []
    # the one copy: the engine server's, read into its own memory (gpu_engine.matrix.load_matrix)
    health = http_json(party.url + "/health")[2]
    assert health["resident_bytes"] == party.matrix.stat().st_size


def test_queries_from_every_web_process_meet_in_one_launch(party):
    activate_policy(party, "wide-window", lane="interactive", mode="throughput", window_us=800_000,
                    max_batch=32)
    deadline = time.monotonic() + 10
    while active_policy_name(party.url) != "wide-window":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)  # every web process has had its PONG
    before = metric(party.url, "gpu_batch_launches_total")
    results = []

    def one() -> None:
        results.append(http_json(party.url + "/query/page/gpu", {"keys": [KEY0_HEX] * 3})[0])

    threads = [threading.Thread(target=one) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [200] * 10
    # ten requests that reached three web processes: one or two launches, not ten
    assert metric(party.url, "gpu_batch_launches_total") - before <= 2
    activate_policy(party, "back-to-latency", lane="interactive", mode="latency")


def test_a_policy_change_reaches_every_web_process_within_a_second(party):
    activate_policy(party, "seen-everywhere", lane="interactive", mode="adaptive")
    committed = time.monotonic()
    consecutive = 0
    while consecutive < 12:  # twelve answers in a row, from whichever web processes take them
        consecutive = consecutive + 1 if active_policy_name(party.url) == "seen-everywhere" else 0
        assert time.monotonic() - committed < 1.0 + 0.5, "a web process still shows the old policy"
    activate_policy(party, "back-to-latency", lane="interactive", mode="latency")


def test_a_bulk_job_runs_through_the_engine_server(party):
    matrix = load_matrix(party.matrix)
    rng = np.random.default_rng(4)
    targets = rng.integers(0, matrix.num_pages, 30)
    keys = [k for t in targets for k in gen_keys(int(t), matrix.domain_bits, rng=rng)]  # 60 keys
    queries = [{"keys": [k.to_bytes().hex() for k in keys[i:i + 3]]} for i in range(0, 60, 3)]
    queries = (queries * 4)[:64]  # 20 distinct queries, repeated
    job = party.json("POST", "/bulk/jobs", {"queries": queries})
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
        job = party.json("GET", f"/bulk/jobs/{job['id']}")
    assert job["status"] == "done", job
    with party.request("GET", f"/bulk/jobs/{job['id']}/results") as response:
        lines = [json.loads(line) for line in response.read().splitlines()]
    assert len(lines) == 64
    flat = KeyBatch.from_keys(keys)
    expected = reference_answers(matrix, flat)
    for line in lines:
        start = (line["index"] % 20) * 3
        assert [bytes.fromhex(p[2:]) for p in line["pages"]] == [expected[start + i].tobytes() for i in range(3)]


def _hammer(url: str, stop: threading.Event, outcomes: list) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            status, headers, _ = http_json(url + "/query/page/gpu", {"keys": [KEY0_HEX] * 3}, timeout=30)
        except (urllib.error.URLError, OSError) as exc:
            status, headers = repr(exc), {}
        outcomes.append((status, time.monotonic() - started, headers.get("Retry-After")))


def test_sigkill_of_the_engine_server_gives_prompt_503s_and_recovers_by_itself(party):
    web_pids = party.pids("web")
    stop, outcomes = threading.Event(), []
    threads = [threading.Thread(target=_hammer, args=(party.url, stop, outcomes)) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    os.kill(party.procs["engine"].pid, signal.SIGKILL)
    party.procs["engine"].wait(10)
    time.sleep(2.0)
    party.start_engine()  # what make run, gpu-workers' supervisor or compose's restart: does
    recovered = party.wait_healthy(120)
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(60)
    statuses = {s for s, _, _ in outcomes}
    assert statuses <= {200, 503}, statuses  # no 500, no broken connection
    refused = [(s, t, r) for s, t, r in outcomes if s == 503]
    assert refused and all(r is not None for _, _, r in refused)  # 503s say when to retry
    assert max(t for _, t, _ in outcomes) < 5.0  # no request waited for the query timeout
    assert outcomes[-1][0] == 200 and recovered < 60
    assert metric(party.url, "pir_engine_up") == 1.0
    assert party.pids("web") == web_pids  # the web tier reconnected; nothing restarted it


def test_a_stopped_engine_server_is_noticed_by_its_deadline(party):
    engine = party.procs["engine"]
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        status, headers, body = http_json(party.url + "/query/page/gpu", {"keys": [KEY0_HEX] * 3})
        waited = time.monotonic() - started
        assert status == 503 and headers.get("Retry-After"), body
        assert waited < DEADLINE_S + 2.0  # the client's deadline, not the 60 s query timeout
        status, _, health = http_json(party.url + "/health")
        assert status == 503 and health["status"] == "unavailable"
        assert metric(party.url, "pir_engine_up") == 0.0
        # silent past the deadline (or, for a web process that never heard it, not yet heard)
        assert "did not answer" in health["failure"] or "not answered yet" in health["failure"], health
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    assert party.wait_healthy(30) < 10


def test_a_bulk_job_survives_sigkill_of_the_engine_server(party):
    matrix = load_matrix(party.matrix)
    key_rows = [gen_keys(t % matrix.num_pages, matrix.domain_bits) for t in range(3)]
    keys = [key_rows[0][0], key_rows[1][0], key_rows[2][1]]
    expected = reference_answers(matrix, KeyBatch.from_keys(keys))
    job = party.json("POST", "/bulk/jobs", {"queries": [{"keys": [k.to_bytes().hex() for k in keys]}] * 600})
    deadline = time.monotonic() + 60
    while party.json("GET", f"/bulk/jobs/{job['id']}")["answered"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(party.procs["engine"].pid, signal.SIGKILL)
    party.procs["engine"].wait(10)
    time.sleep(1.0)
    party.start_engine()
    deadline = time.monotonic() + 240
    while job["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"{job}\n{party.log('workers')}"
        time.sleep(0.5)
        job = party.json("GET", f"/bulk/jobs/{job['id']}")
    assert job["status"] == "done" and job["answered"] == 600, job
    with party.request("GET", f"/bulk/jobs/{job['id']}/results") as response:
        lines = [json.loads(line) for line in response.read().splitlines()]
    assert sorted(line["index"] for line in lines) == list(range(600))  # each once
    assert all([bytes.fromhex(p[2:]) for p in line["pages"]] == [e.tobytes() for e in expected]
               for line in lines)


def test_an_epoch_switch_reaches_every_web_process_within_a_second(party):
    # beside the served file: epochs come from the matrix directory (MORPHO_MATRIX_DIR)
    path = party.matrix.with_name("engine-server-next.bin")
    write_matrix_file(path, 300, seed=9)  # 300 pages: domain_bits 9 instead of the vectors' 8
    write_epoch_metadata(path, epoch_id=41)
    party.manage("load_epoch", str(path), "--activate")
    every_web_process_serves(party.url, 41, 9, since=time.monotonic(), within=1.0 + 0.5)
    k0, k1 = gen_keys(123, 9)
    a = http_json(party.url + "/query/page/gpu", {"keys": [k0.to_bytes().hex()] * 3})[2]
    b = http_json(party.url + "/query/page/gpu", {"keys": [k1.to_bytes().hex()] * 3})[2]
    assert a["epoch_id"] == b["epoch_id"] == 41
    page = bytes(x ^ y for x, y in zip(bytes.fromhex(a["pages"][0][2:]), bytes.fromhex(b["pages"][0][2:])))
    assert page == load_matrix(path).page(123)

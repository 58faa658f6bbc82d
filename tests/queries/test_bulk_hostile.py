"""Hostile bulk bodies against a real gunicorn: refused with bounded memory while queries are
still answered at once (64 MiB of `[[],[],...]` parsed whole would take 1.2 GB and stall queries
for 11-15 s); a large valid binary body taken with bounded memory."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from morpho_pir.dpf import gen_keys
from tests.conftest import REPO, server_env, wait_until
from tests.protocol_vectors import KEY0_HEX, KEY1_HEX

pytestmark = pytest.mark.processes

MIB = 1 << 20
BODY_BYTES = 64 * MIB
RSS_GROWTH_LIMIT = 100 * MIB
# One query on the vector matrix takes a few ms here; a second is the bound, generous
# for a loaded 2-core CI machine (it was 14.5 s while the body was parsed).
QUERY_SECONDS = 1.0


def hostile_bodies() -> dict[str, tuple[str, bytes]]:
    pairs = (BODY_BYTES - 2) // 3
    return {
        "json array of empty arrays": ("application/json", b"[" + b"[]," * pairs + b"[]]"),
        "ndjson lines of empty arrays": ("application/x-ndjson", b"[]\n" * (BODY_BYTES // 3)),
        "one 64 MiB json string": (
            "application/json", b'{"queries": [], "x": "' + b"a" * (BODY_BYTES - 40) + b'"}'),
        "one 64 MiB ndjson line": (
            "application/x-ndjson", b"[" + b"0," * (BODY_BYTES // 2) + b"0]"),
        "json nested 64 MiB deep": ("application/json", b"[" * BODY_BYTES),
    }


@pytest.fixture(scope="module")
def party(start_server, vector_matrix_path, tmp_path_factory):
    var = tmp_path_factory.mktemp("hostile-var")
    env = server_env(MORPHO_MATRIX_PATH=vector_matrix_path, MORPHO_ENGINE_BACKEND="cpu",
                     MORPHO_VAR_DIR=var, DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}",
                     MORPHO_BULK_SUBMIT_THROTTLE="off")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                   check=True)
    made = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c",
         "from django.contrib.auth.models import User; from rest_framework.authtoken.models "
         "import Token; print(Token.objects.create(user=User.objects.create_user('mallory')).key)"],
        cwd=REPO, env=env, check=True, capture_output=True, text=True)
    server = start_server("gunicorn", env)
    return server, made.stdout.split()[-1]  # the last line: shell may announce its imports


def worker_pid(master: int) -> int:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    assert len(children) == 1, children  # one gunicorn worker
    return int(children[0])


def reset_peak(pid: int) -> None:
    """Start the process's VmHWM (peak RSS) afresh from its RSS now (Linux 4.0+), so a peak
    reached earlier (the engine's start) cannot hide the request's."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def memory(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak since reset_peak) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def post(url: str, path: str, body: bytes, headers: dict, timeout: float = 300):
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def timed_queries(url: str, stop: threading.Event, took: list) -> None:
    body = json.dumps({"keys": [KEY0_HEX, KEY1_HEX, KEY0_HEX]}).encode()
    while not stop.is_set():
        began = time.monotonic()
        status, _, _ = post(url, "/query/page/gpu", body, {"Content-Type": "application/json"})
        took.append((began, time.monotonic() - began, status))


@pytest.mark.parametrize("kind", list(hostile_bodies()))
def test_a_hostile_body_is_refused_with_bounded_memory_and_queries_keep_flowing(party, kind):
    server, token = party
    content_type, body = hostile_bodies()[kind]
    pid = worker_pid(server.proc.pid)
    reset_peak(pid)
    before = memory(pid)
    stop, took = threading.Event(), []
    prober = threading.Thread(target=timed_queries, args=(server.url, stop, took))
    prober.start()
    try:
        wait_until(lambda: took, 60, "no query was answered before the hostile body")
        sent = time.monotonic()
        status, headers, answer = post(server.url, "/bulk/jobs", body, {
            "Content-Type": content_type, "Authorization": f"Token {token}"})
        answered = time.monotonic()
        wait_until(lambda: any(began >= answered for began, _, _ in took), 60,
                   "no query was answered after the hostile request")
    finally:
        stop.set()
        prober.join(120)
    after = memory(pid)
    assert status == 400, answer[:500]
    assert headers["Content-Type"] == "application/json"
    assert json.loads(answer)["errors"], answer[:500]
    growth = after["VmHWM"] - before["VmHWM"]
    assert growth < RSS_GROWTH_LIMIT, f"peak RSS grew by {growth / MIB:.0f} MiB ({kind})"
    during = [t for t in took if t[0] < answered and t[0] + t[1] > sent]
    assert during, "no query overlapped the hostile request"
    assert all(status == 200 for _, _, status in took), took
    slowest = max(t[1] for t in took)
    assert slowest < QUERY_SECONDS, f"a query took {slowest:.2f} s during the hostile body"


def test_a_large_binary_body_is_read_as_a_stream_not_held_whole(party):
    # 48 MiB of valid v1 keys (about 94,000 queries): read, checked and stored a piece at a time,
    # so the worker's peak RSS grows by what the README promises a submission holds, not by the
    # body's size (it grew by 170-202 MiB for a 200 MiB body read whole).
    server, token = party
    rng = np.random.default_rng(3)
    query = b"".join(k.to_bytes() for k in (*gen_keys(5, 8, rng=rng), gen_keys(9, 8, rng=rng)[0]))
    count = 48 * MIB // len(query)
    pid = worker_pid(server.proc.pid)
    reset_peak(pid)
    before = memory(pid)
    status, _, answer = post(server.url, "/bulk/jobs", query * count, {
        "Content-Type": "application/octet-stream", "Authorization": f"Token {token}"})
    after = memory(pid)
    assert status == 201, answer[:500]
    assert json.loads(answer)["total"] == count
    growth = after["VmHWM"] - before["VmHWM"]
    assert growth < 16 * MIB, f"peak RSS grew by {growth / MIB:.1f} MiB for a 48 MiB body"

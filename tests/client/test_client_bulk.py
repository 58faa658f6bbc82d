"""The client's bulk fetch against two live parties (gunicorn + `bin/gpu-workers` each), and its
refusal of one server named as both parties."""
from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest

from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file
from morpho_client import (
    EpochMismatch,
    PirClient,
    SameServer,
    StateMismatch,
    check_distinct_servers,
    server_address,
)
from morpho_client.cli import print_progress
from morpho_client.plan import BulkState, StateError, read_rows_file
from tests.conftest import REPO, http_json, server_env

PAGES = 64  # 1,024 rows, domain_bits 6: a job of a few dozen queries takes a second on the CPU
EPOCH = 21


class Party:
    """One operator: its own database with a user and token, a web server and its bulk workers."""

    def __init__(self, name, tmp, matrix, start_server) -> None:
        self.env = server_env(
            MORPHO_MATRIX_PATH=matrix, MORPHO_ENGINE_BACKEND="cpu", MORPHO_VAR_DIR=tmp,
            DATABASE_URL=f"sqlite:///{tmp / f'party-{name}.sqlite3'}",
            CELERY_FILESYSTEM_BROKER_DIR=tmp / f"broker-{name}",
            MORPHO_BULK_CHUNK=16, MORPHO_BULK_QUEUE=f"client-bulk-{uuid.uuid4().hex[:8]}",
            MORPHO_BULK_SWEEP_SECONDS=0.5, CUDA_VISIBLE_DEVICES="",
        )
        self.manage("migrate", "--no-input", "-v0")
        self.manage("shell", "-v0", "-c",
                    "from django.contrib.auth.models import User\n"
                    "User.objects.create_user('reader')")
        out = self.manage("drf_create_token", "reader")
        self.token = out.split()[2]  # "Generated token <key> for user reader"
        self.web = start_server("gunicorn", self.env)
        self.url = self.web.url
        self._log = open(tmp / f"workers-{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.workers = subprocess.Popen([sys.executable, "bin/gpu-workers"], cwd=REPO,
                                        env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def manage(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def jobs(self) -> list[dict]:
        request = urllib.request.Request(self.url + "/bulk/jobs",
                                         headers={"Authorization": f"Token {self.token}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.loads(response.read())
        return body["results"] if isinstance(body, dict) else body

    def stop(self) -> None:
        self.workers.terminate()
        try:
            self.workers.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.workers.pid, signal.SIGKILL)
            self.workers.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def matrix_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bulk-client") / "matrix.bin"
    write_matrix_file(path, PAGES, seed=5)
    write_epoch_metadata(path, epoch_id=EPOCH, block_number=3)
    return path


@pytest.fixture(scope="module")
def parties(start_server, matrix_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bulk-parties")
    started = []
    try:
        for name in "ab":
            started.append(Party(name, tmp, matrix_file, start_server))
        yield started
    finally:
        for party in started:
            party.stop()


@pytest.fixture(scope="module")
def expected(matrix_file):
    return load_matrix(matrix_file)


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "morpho_client", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


@pytest.mark.processes
def test_cli_bulk_fetch_writes_every_row(parties, expected, tmp_path):
    a, b = parties
    rows = [0, 5, 1023, 17, 17, 600] + list(range(100, 130))
    rows_file = tmp_path / "rows.txt"
    rows_file.write_text("# rows to read\n" + "\n".join(map(str, rows[:3])) + "\n\n"
                         + "\n".join(f"{r}  # one row" for r in rows[3:]) + "\n")
    out = tmp_path / "rows.out"
    before = [len(p.jobs()) for p in parties]
    result = run_cli("--server-a", a.url, "--server-b", b.url, "--bulk", str(rows_file),
                     "--out", str(out), "--token-a", a.token, "--token-b", b.token,
                     "--poll", "0.3")
    assert result.returncode == 0, result.stderr
    assert out.read_text().splitlines() == [f"row {r}: 0x{expected.row(r).hex()}" for r in rows]
    assert f"wrote {len(rows)} rows to {out}" in result.stderr
    assert "A: job " in result.stderr and " done 36/36" in result.stderr  # progress lines
    assert not (tmp_path / "rows.txt.state.json").exists()  # removed once every row was read
    assert [len(p.jobs()) for p in parties] == [n + 1 for n in before]  # one job per party


@pytest.mark.processes
def test_a_crashed_fetch_resumes_the_same_jobs(parties, expected, tmp_path):
    a, b = parties
    rows = list(range(200, 240, 3))
    state = tmp_path / "fetch.state.json"

    class Crash(Exception):
        pass

    def crash(job_a, job_b):
        raise Crash  # the client dies once both jobs are submitted

    with PirClient(a.url, b.url) as client:
        with pytest.raises(Crash):
            client.fetch_rows_bulk(rows, (a.token, b.token), state, progress=crash)
    saved = json.loads(state.read_text())
    assert None not in saved["jobs"] and len(bytes.fromhex(saved["seeds"])) == len(rows) * 3 * 32
    assert oct(state.stat().st_mode & 0o777) == "0o600"
    jobs_before = [len(p.jobs()) for p in parties]
    rows_file = tmp_path / "rows.txt"
    rows_file.write_text("\n".join(map(str, rows)))
    # The rerun reads the tokens from the environment and finds the jobs in the state file.
    result = run_cli("--server-a", a.url, "--server-b", b.url, "--bulk", str(rows_file),
                     "--state", str(state), "--poll", "0.3",
                     env={"MORPHO_TOKEN_A": a.token, "MORPHO_TOKEN_B": b.token})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"row {r}: 0x{expected.row(r).hex()}" for r in rows]
    assert f"A: job {saved['jobs'][0]} " in result.stderr
    assert f"B: job {saved['jobs'][1]} " in result.stderr
    assert [len(p.jobs()) for p in parties] == jobs_before  # nothing submitted again
    assert not state.exists()


@pytest.mark.processes
def test_a_crash_between_the_two_submissions_sends_the_same_keys_to_b(parties, expected, tmp_path):
    a, b = parties
    rows = [7, 300, 1000]
    state_path = tmp_path / "half.state.json"
    with PirClient(a.url, b.url) as client:
        info = client.epoch()
        state = BulkState.plan(client.servers, info.epoch_id, info.num_pages, info.domain_bits,
                               rows, [r // 16 for r in rows])
        state.jobs[0] = client._run(client.core._bulk_submit(a.url, a.token, state, 0))
        state.save(state_path)  # the state as a client that died before submitting to B left it
        assert client.fetch_rows_bulk(rows, (a.token, b.token), state_path,
                                      poll_interval=0.3) == [expected.row(r) for r in rows]
    assert not state_path.exists()


class EpochRewritingProxy:
    """Forwards everything to a party, but names another epoch in its results lines."""

    def __init__(self, target: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                request = urllib.request.Request(
                    target + self.path, data=self.rfile.read(length) if length else None,
                    method=self.command,
                    headers={k: v for k, v in self.headers.items()
                             if k in ("Authorization", "Content-Type", "Accept")})
                with urllib.request.urlopen(request, timeout=60) as response:
                    status, body = response.status, response.read()
                    kind = response.headers.get("Content-Type", "")
                if self.path.endswith("/results"):
                    body = body.replace(f'"epoch_id": {EPOCH},'.encode(),
                                        f'"epoch_id": {EPOCH + 1},'.encode())
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.processes
def test_answers_from_different_epochs_are_refused(parties, tmp_path):
    a, b = parties
    proxy = EpochRewritingProxy(b.url)
    state = tmp_path / "epochs.state.json"
    try:
        with PirClient(a.url, proxy.url) as client:
            with pytest.raises(EpochMismatch) as caught:
                client.fetch_rows_bulk([1, 2], (a.token, b.token), state, poll_interval=0.3)
    finally:
        proxy.close()
    assert str(caught.value) == (
        f"query 0 (row 1) was answered from epoch {EPOCH} by A and epoch {EPOCH + 1} by B: the "
        f"jobs ran across an epoch switch and their answers cannot be combined; remove {state} "
        "to submit new jobs"
    )
    assert state.exists()  # kept: the user decides


@pytest.mark.processes
def test_bulk_needs_tokens_and_a_state_for_these_rows(parties, tmp_path):
    a, b = parties
    rows_file = tmp_path / "rows.txt"
    rows_file.write_text("1\n2\n")
    result = run_cli("--server-a", a.url, "--server-b", b.url, "--bulk", str(rows_file),
                     "--token-a", a.token, env={"MORPHO_TOKEN_B": ""})
    assert result.returncode == 1
    assert "bulk jobs need a DRF token for each party; none for B" in result.stderr
    result = run_cli("--server-a", a.url, "--server-b", b.url, "--bulk", str(rows_file),
                     "--token-a", a.token, "--token-b", "wrong")
    assert result.returncode == 1 and "/bulk/jobs: HTTP 401" in result.stderr
    # A state file written for other rows is refused, not silently reused.
    with PirClient(a.url, b.url) as client:
        info = client.epoch()
        BulkState.plan(client.servers, info.epoch_id, info.num_pages, info.domain_bits,
                       [5], [0]).save(tmp_path / "other.json")
        with pytest.raises(StateError, match="is the state of a fetch of other rows"):
            client.fetch_rows_bulk([1, 2], (a.token, b.token), tmp_path / "other.json")


def test_rows_file_errors_name_the_line(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("1\n\n# note\n2x\n")
    with pytest.raises(ValueError, match=r"rows.txt, line 4: expected a row number, got '2x'"):
        read_rows_file(path)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no rows in it"):
        read_rows_file(path)


@pytest.mark.parametrize("a, b", [
    ("http://127.0.0.1:8001", "http://127.0.0.1:8001/"),
    ("http://127.0.0.1:8001", "http://localhost:8001"),
    ("http://LOCALHOST:8001/x", "http://[::1]:8001/y"),
    ("http://pir.example.org", "HTTP://PIR.example.org.:80/"),
    ("https://pir.example.org", "http://pir.example.org:443"),
])
def test_one_server_named_as_both_parties_is_refused(a, b):
    with pytest.raises(SameServer, match=r"are the same server \(.*\): it would see both keys"):
        PirClient(a, b)


def test_distinct_servers_and_bad_urls():
    check_distinct_servers("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    check_distinct_servers("http://a.example.org", "http://b.example.org")
    assert server_address("https://Pir.Example.org/") == ("pir.example.org", 443)
    with pytest.raises(ValueError, match="expected an http:// or https:// URL"):
        server_address("127.0.0.1:8001")
    with pytest.raises(ValueError, match="the port is not a number"):
        server_address("http://host:99999")


@pytest.mark.processes
def test_cli_refuses_the_same_server_twice():
    result = run_cli("--server-a", "http://127.0.0.1:8001", "--server-b", "http://localhost:8001",
                     "--row", "1", timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(
        "error: party A (http://127.0.0.1:8001) and party B (http://localhost:8001) are the same "
        "server (localhost:8001)")



@pytest.mark.processes
def test_a_missing_rows_file_is_one_error_line(tmp_path):
    missing = tmp_path / "no-such-rows.txt"
    result = run_cli("--server-a", "http://127.0.0.1:9", "--server-b", "http://127.0.0.1:10",
                     "--bulk", str(missing), "--token-a", "t", "--token-b", "t", timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and str(missing) in result.stderr
    assert "Traceback" not in result.stderr


def test_progress_lines_count_launch_by_launch(capsys):
    running = {"id": 7, "status": "running", "answered": 0, "total": 512,
               "progress": {"answered": 96, "total": 512}}
    print_progress(running, {**running, "id": 8})
    assert capsys.readouterr().err.strip() == "A: job 7 running 96/512  B: job 8 running 96/512"


# --- served states (docs/PROTOCOL.md section 6): last in this module, since they write rows -----

UPDATED_ROW = 5 * 16 + 3  # a row of page 5
UPDATED_DATA = bytes((11 * i + 5) % 256 for i in range(256))


def push_row(party: Party) -> None:
    """An operator's row update at one party, stored by another process, as in production."""
    party.manage("shell", "-v0", "-c",
                 f"from epochs.sync import push_rows; push_rows([({UPDATED_ROW}, {UPDATED_DATA!r})])")


def wait_updates(party: Party, updates: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        state = http_json(party.url + "/epoch")[2]["state"]
        if state["updates"] == updates or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def test_result_lines_carry_their_state(parties):
    a, _ = parties
    with PirClient(a.url, parties[1].url) as client:
        state = BulkState.plan(client.servers, EPOCH, PAGES, 6, [1, 2], [0, 0])
        job = client._run(client.core._bulk_submit(a.url, a.token, state, 0))
    deadline = time.monotonic() + 60
    while [j for j in a.jobs() if str(j["id"]) == job][0]["status"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    request = urllib.request.Request(f"{a.url}/bulk/jobs/{job}/results",
                                     headers={"Authorization": f"Token {a.token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [json.loads(line) for line in response.read().splitlines()]
    served = http_json(a.url + "/epoch")[2]["state"]
    assert [line["state"] for line in lines] == [served, served]
    request.add_header("Accept", "application/octet-stream")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["X-Morpho-State-Ranges"] == (
            f"0-1={EPOCH}:{served['updates']}:{served['digest']}")


def test_a_row_update_on_one_party_is_refused_never_a_wrong_row(parties, expected, tmp_path):
    a, b = parties
    rows = [UPDATED_ROW, UPDATED_ROW + 16, 7] + list(range(400, 430))
    # Mid-job: A takes the update once both jobs are submitted. Whether A's job was answered
    # before or after it, the fetch is all old rows or a StateMismatch, never a mixed row.
    pushed = []

    def update_a(job_a, job_b):
        if not pushed:
            pushed.append(push_row(a))

    with PirClient(a.url, b.url) as client:
        try:
            got = client.fetch_rows_bulk(rows, (a.token, b.token), progress=update_a,
                                         poll_interval=0.2)
        except StateMismatch as exc:
            assert "answered from different states" in str(exc)
        else:
            assert got == [expected.row(r) for r in rows]
    assert wait_updates(a, 1)["updates"] == 1 and wait_updates(b, 0)["updates"] == 0
    # Once A holds the update and B does not, every fetch is refused: a clear error, exit 1.
    rows_file, out = tmp_path / "rows.txt", tmp_path / "rows.out"
    rows_file.write_text("\n".join(map(str, rows)))
    result = run_cli("--server-a", a.url, "--server-b", b.url, "--bulk", str(rows_file),
                     "--out", str(out), "--token-a", a.token, "--token-b", b.token, "--poll", "0.3")
    assert result.returncode == 1 and not out.exists()
    assert "query 0 (row 83) was answered from different states: A (" in result.stderr
    assert "with 1 row updates" in result.stderr and "with 0 row updates" in result.stderr
    # B takes the same update: one state again, and the fetch gives the updated row.
    push_row(b)
    assert wait_updates(b, 1) == wait_updates(a, 1)
    with PirClient(a.url, b.url) as client:
        got = client.fetch_rows_bulk(rows, (a.token, b.token), poll_interval=0.2)
    assert got == [UPDATED_DATA if r == UPDATED_ROW else expected.row(r) for r in rows]

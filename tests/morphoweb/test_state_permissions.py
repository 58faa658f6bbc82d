"""`make run`'s state is its user's alone, and its matrices lie apart from it (real processes).

A local user once reached gunicorn's 0777 socket around the front end (40 trickling connections
timed /health out; a spoofed X-Forwarded-For passed the request limit) and could read the 0644
databases; and an epoch of `party-a.sqlite3`, in the matrix folder that was the state folder,
published the admin's password hash to anonymous clients. Here the supervisor runs as `make run`
runs it, and the test looks at what it made and tries both from outside."""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, server_env
from tests.morphoweb.test_devserver import children_of

pytestmark = pytest.mark.processes

NOBODY = 65534


def _party_env(var: Path, party: str) -> dict:
    return server_env(MORPHO_VAR_DIR=var, DATABASE_URL=f"sqlite:///{var}/party-{party}.sqlite3",
                      MORPHO_MATRIX_PATH=var / "matrices" / "demo-64p.bin")


def _post(url: str, body: dict, token: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _as_nobody(code: str) -> subprocess.CompletedProcess:
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    return subprocess.run([python, "-c", code], user=NOBODY, group=NOBODY, extra_groups=[],
                          capture_output=True, text=True, timeout=60, cwd="/")


@pytest.fixture(scope="module")
def make_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state")
    # The state folder where other users may walk up to it, as under a checkout in /srv or a
    # home folder of mode 0755 (pytest's own temporary folders are 0700, which would hide it).
    outer = Path(tempfile.mkdtemp(prefix="morpho-state-"))
    outer.chmod(0o755)
    var = outer / "v"
    port = free_port()
    env = server_env(MORPHO_VAR_DIR=var, DEMO_PAGES=64, MORPHO_ENGINE_BACKEND="cpu",
                     MORPHO_WEB_WORKERS=1, CUDA_VISIBLE_DEVICES="")
    env.pop("DATABASE_URL", None)
    log_path = tmp / "run.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the supervisor writes to it
    run = subprocess.Popen([sys.executable, "-m", "morphoweb.devserver", "--port-a", str(port),
                            "--port-b", str(free_port())], cwd=REPO, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while b"Ctrl-C stops everything" not in log_path.read_bytes():
            assert run.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        yield var, f"http://127.0.0.1:{port}"
    finally:
        family = children_of(run.pid)
        run.send_signal(signal.SIGTERM)
        try:
            run.wait(90)
        except subprocess.TimeoutExpired:
            for pid in family + [run.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        log.close()
        shutil.rmtree(outer, ignore_errors=True)


def test_state_folder_and_everything_in_it_are_the_users_alone(make_run):
    var, _ = make_run
    assert stat.S_IMODE(var.stat().st_mode) == 0o700
    seen = {}
    for path in [var, *var.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        seen[path.relative_to(var).as_posix()] = mode
        assert mode & 0o007 == 0, f"{path} is {mode:o}: other users may use it"
    for party in "ab":
        assert seen[f"party-{party}.sqlite3"] == 0o600
        assert seen[f"web-{party}.sock"] == 0o660  # was 0777
        assert seen[f"engine-{party}.sock"] & 0o077 & ~0o060 == 0
        assert stat.S_ISSOCK((var / f"web-{party}.sock").lstat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_another_local_user_reaches_neither_gunicorn_nor_the_databases(make_run):
    var, _ = make_run
    connect = _as_nobody(
        "import socket; s = socket.socket(socket.AF_UNIX); "
        f"s.connect({str(var / 'web-a.sock')!r}); print('connected')")
    assert "connected" not in connect.stdout
    assert "PermissionError" in connect.stderr
    read = _as_nobody(f"open({str(var / 'party-a.sqlite3')!r}, 'rb').read(16); print('read')")
    assert "read" not in read.stdout and "PermissionError" in read.stderr


def test_the_matrices_lie_apart_and_the_partys_database_is_no_epoch(make_run):
    var, url = make_run
    matrices = var / "matrices"
    assert sorted(p.name for p in matrices.iterdir()) == ["demo-64p.bin", "demo-64p.bin.epoch.json"]
    env = _party_env(var, "a")
    env["DJANGO_SUPERUSER_PASSWORD"] = "pw-state-test"
    subprocess.run([sys.executable, "manage.py", "createsuperuser", "--no-input",
                    "--username", "op", "--email", "op@example.org"], cwd=REPO, env=env,
                   check=True, capture_output=True, timeout=120)
    token = subprocess.run([sys.executable, "manage.py", "drf_create_token", "op"], cwd=REPO,
                           env=env, check=True, capture_output=True, text=True,
                           timeout=120).stdout.split()[2]
    for given in ("party-a.sqlite3", "../party-a.sqlite3", str(var / "party-a.sqlite3")):
        status, body = _post(url + "/api/epochs/", {"epoch_id": 66, "matrix_path": given}, token)
        assert status == 400, body
        assert body["errors"][0]["field"] == "matrix_path"
    # A file copied into the matrix folder is still no matrix without its sidecar.
    shutil.copy(var / "party-a.sqlite3", matrices / "copy.sqlite3")
    status, body = _post(url + "/api/epochs/", {"epoch_id": 66, "matrix_path": "copy.sqlite3"},
                         token)
    assert status == 400 and "is not described as a matrix" in body["detail"], body

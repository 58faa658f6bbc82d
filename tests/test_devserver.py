"""`make run`'s supervisor: chosen ports and state folder, busy ports refused, SIGHUP stops all.

Runs `python -m morphoweb.devserver` as `make run PORT_A= PORT_B= VAR=` does, on a tiny demo
matrix, and checks what a user meets: both parties answer, each with its own engine server,
control socket and databases under VAR; a second instance on the same ports is refused before it
starts anything; closing the terminal (SIGHUP) leaves no process and no port behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, http_json, server_env, wait_until

pytestmark = pytest.mark.processes


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                found += [int(entry.name)] + children_of(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return state != "Z"


def test_make_run_ports_state_folder_busy_ports_and_sighup(tmp_path):
    var = tmp_path / "v"
    ports = free_port(), free_port()
    env = server_env(MORPHO_VAR_DIR=var, DEMO_PAGES=64, MORPHO_ENGINE_BACKEND="cpu",
                     MORPHO_WEB_WORKERS=2, CUDA_VISIBLE_DEVICES="")
    argv = [sys.executable, "-m", "morphoweb.devserver", "--port-a", str(ports[0]),
            "--port-b", str(ports[1])]
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115 - the supervisor writes to it
    run = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while b"Ctrl-C stops everything" not in (tmp_path / "run.log").read_bytes():
            assert run.poll() is None, (tmp_path / "run.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "run.log").read_text()
            time.sleep(0.5)
        for port, party in zip(ports, "ab"):
            status, _, health = http_json(f"http://127.0.0.1:{port}/health")
            assert status == 200 and health["engine_url"] == f"ipc://{var}/engine-{party}.sock"
            assert (var / f"party-{party}.sqlite3").exists()
            assert (var / f"gunicorn-{party}.ctl").exists()  # each party its own control socket
        # a second `make run` on the same ports is refused before it starts anything
        second = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert f"port {ports[0]} (party A)" in second.stderr and "PORT_A=" in second.stderr
        assert http_json(f"http://127.0.0.1:{ports[0]}/health")[0] == 200  # the first one serves on
        family = children_of(run.pid)
        assert len(family) >= 8  # per party: engine server, gunicorn master + 2 workers, workers
        run.send_signal(signal.SIGHUP)  # the terminal closed
        assert run.wait(90) == 0
        wait_until(lambda: [pid for pid in family if alive(pid)] == [], 10,
                   f"a process of {family} outlived the supervisor")
        for port in ports:
            assert http_json_fails(f"http://127.0.0.1:{port}/health")
    finally:
        if run.poll() is None:
            for pid in children_of(run.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run.kill()
        log.close()


def http_json_fails(url: str) -> bool:
    try:
        http_json(url, timeout=3)
    except OSError:
        return True
    return False

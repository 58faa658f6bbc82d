"""`make run`'s supervisor: chosen ports and state folder, busy ports refused, SIGHUP stops all.

Runs `python -m morphoweb.devserver` as `make run PORT_A= PORT_B= VAR=` does, on a tiny demo
matrix, and checks what a user meets: both parties answer, each with its own engine server,
control socket and databases under VAR; a second instance on the same ports is refused before it
starts anything; closing the terminal (SIGHUP) leaves no process and no port behind, and neither
does killing `make run`'s make alone."""
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


def wait_for_banner(proc: subprocess.Popen, log: Path, timeout: float = 240) -> str:
    """The supervisor's output once it says it serves (it printed "Ctrl-C stops everything")."""
    deadline = time.monotonic() + timeout
    while b"Ctrl-C stops everything" not in log.read_bytes():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    return log.read_text()


def kill_family(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def small_parties(var: Path) -> tuple[tuple[int, int], dict, list[str]]:
    """(ports, environment, argv) of `make run`'s supervisor on two free ports, the state folder
    `var` and a 64-page demo matrix on the CPU backend."""
    ports = free_port(), free_port()
    env = server_env(MORPHO_VAR_DIR=var, DEMO_PAGES=64, MORPHO_ENGINE_BACKEND="cpu",
                     MORPHO_WEB_WORKERS=2, CUDA_VISIBLE_DEVICES="")
    argv = [sys.executable, "-m", "morphoweb.devserver", "--port-a", str(ports[0]),
            "--port-b", str(ports[1])]
    return ports, env, argv


def test_make_run_ports_state_folder_busy_ports_and_sighup(tmp_path):
    var = tmp_path / "v"
    ports, env, argv = small_parties(var)
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115 - the supervisor writes to it
    run = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_banner(run, tmp_path / "run.log")
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
            kill_family(children_of(run.pid))
            run.kill()
        log.close()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("stop", ["kill make", "kill -INT, started in the background"])
def test_killing_make_alone_stops_every_process_and_frees_the_ports(tmp_path, stop):
    """`kill <make's pid>` (or a tmux or screen session closed around make) signals make only:
    the supervisor must notice that its parent has gone and stop both parties, as Ctrl-C does.
    A script that starts `make run &` leaves SIGINT ignored in it, as shells do for background
    jobs: `kill -INT` to the supervisor stops everything all the same."""
    var = tmp_path / "v"
    ports = free_port(), free_port()
    env = server_env(DEMO_PAGES=64, MORPHO_ENGINE_BACKEND="cpu", MORPHO_WEB_WORKERS=2,
                     CUDA_VISIBLE_DEVICES="")
    argv = ["make", "--no-print-directory", "-o", ".venv/.installed-stamp", "run",
            f"PY={sys.executable}", f"PORT_A={ports[0]}", f"PORT_B={ports[1]}", f"VAR={var}"]
    log_path = tmp_path / "run.log"
    log = open(log_path, "wb")  # noqa: SIM115 - make and the supervisor write to it
    # a session of its own, as a terminal's: only make is signalled below, not its group
    make = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=_ignore_sigint if "INT" in stop else None)
    family: list[int] = []
    try:
        wait_for_banner(make, log_path)
        family = children_of(make.pid)
        assert len(family) >= 9  # the supervisor, and per party its engine server, web, workers
        for port in ports:
            assert http_json(f"http://127.0.0.1:{port}/health")[0] == 200
        if "INT" in stop:
            os.kill(family[0], signal.SIGINT)  # the supervisor, make's child
        else:
            make.send_signal(signal.SIGTERM)
        make.wait(30)
        deadline = time.monotonic() + 90
        while [pid for pid in family if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [pid for pid in family if alive(pid)] == [], log_path.read_text()
        for port in ports:
            assert http_json_fails(f"http://127.0.0.1:{port}/health")
        assert "stopping both parties" in log_path.read_text()
    finally:
        kill_family(family)
        if make.poll() is None:
            make.kill()
        log.close()


def http_json_fails(url: str) -> bool:
    try:
        http_json(url, timeout=3)
    except OSError:
        return True
    return False

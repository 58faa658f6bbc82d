"""Epoch switches as an operator of `make run` meets them: `make epoch` switches both parties in one
command, a restart serves the switched epoch at once (not the demo matrix first) and its banner
says so, a switch that cannot happen (no epoch id, the parties stopped) records nothing and says why,
and load_epoch refuses a database that is missing, as the other commands do."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing

import pytest

from tests.conftest import REPO, http_json, server_env
from tests.morphoweb.test_devserver import children_of, kill_family, small_parties, wait_for_banner

pytestmark = pytest.mark.processes


def test_load_epoch_refuses_a_missing_database_without_creating_it(tmp_path):
    db = tmp_path / "db.sqlite3"
    (tmp_path / "m").mkdir()
    result = subprocess.run(
        [sys.executable, "manage.py", "load_epoch", str(tmp_path / "m" / "e.bin"), "--activate"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env=server_env(DATABASE_URL=f"sqlite:///{db}", MORPHO_MATRIX_DIR=tmp_path / "m"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"CommandError: the database {db} does not exist. `make run` "
                                    "keeps its parties' epochs in var/party-a.sqlite3 and "
                                    "var/party-b.sqlite3: `make epoch MATRIX=FILE` records and "
                                    "activates an epoch on both")
    assert not db.exists()


def make(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed-stamp", *args,
                           f"PY={sys.executable}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def start(argv, env, log_path) -> tuple[subprocess.Popen, object]:
    log = open(log_path, "wb")  # noqa: SIM115 - the supervisor writes to it
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log


def stop(run: subprocess.Popen, log) -> None:
    family = children_of(run.pid)
    if run.poll() is None:
        run.send_signal(signal.SIGTERM)
        try:
            run.wait(90)
        except subprocess.TimeoutExpired:
            kill_family(family)
            run.kill()
    log.close()


def test_make_epoch_switches_both_parties_and_a_restart_serves_that_epoch(tmp_path):
    var = tmp_path / "v"
    ports, env, argv = small_parties(var)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    epoch7 = var / "matrices" / "epoch7.bin"  # a folder of matrices alone, as epochs need
    run, log = start(argv, env, tmp_path / "run1.log")
    try:
        banner = wait_for_banner(run, tmp_path / "run1.log")
        assert "serves epoch 1 (block 0, 64 pages)" in banner
        assert f"`make epoch MATRIX=FILE VAR={var}` switches both parties" in banner
        assert f"`make superuser VAR={var}`" in banner  # where the parties' databases are
        made = subprocess.run(
            [sys.executable, "manage.py", "make_matrix", "--pages", "128", "--seed", "7",
             "--epoch-id", "7", "--block-number", "77", "--out", str(epoch7)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert made.returncode == 0, made.stderr
        switched = make("epoch", f"MATRIX={epoch7}", f"VAR={var}", env=env)
        assert switched.returncode == 0, switched.stdout + switched.stderr
        assert "party A: epoch 7 is active" in switched.stdout
        assert "party B: epoch 7 is active" in switched.stdout
        assert switched.stdout.rstrip().endswith("both parties serve epoch 7")
        deadline = time.monotonic() + 30
        while {http_json(url + "/epoch")[2]["epoch_id"] for url in urls} != {7}:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        again = make("epoch", f"MATRIX={epoch7}", f"VAR={var}", env=env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "party A: already serves epoch 7; left as it is" in again.stdout
        assert "party B: already serves epoch 7; left as it is" in again.stdout
    finally:
        stop(run, log)

    # Restarted: each engine server loads epoch 7's file, never the demo matrix's, and the
    # banner names the epoch each party serves.
    run, log = start(argv, env, tmp_path / "run2.log")
    try:
        banner = wait_for_banner(run, tmp_path / "run2.log")
        assert banner.count("serves epoch 7 (block 77, 128 pages) on ") == 2, banner
        assert f"serving epoch 7 (block 77) from {epoch7}: 128 pages" in banner
        assert "serving epoch 1 " not in banner and "demo-64p.bin:" not in banner
        for url in urls:
            status, _, health = http_json(url + "/health")
            assert status == 200 and health["epoch_id"] == 7
    finally:
        stop(run, log)


def test_make_epoch_with_the_parties_stopped_records_nothing_and_says_why(tmp_path):
    var = tmp_path / "v"
    (var / "matrices").mkdir(parents=True)
    _, env, _ = small_parties(var)
    for party in "ab":
        migrated = subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"],
                                  cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                                  env={**env, "DATABASE_URL": f"sqlite:///{var}/party-{party}.sqlite3"})
        assert migrated.returncode == 0, migrated.stderr
    epoch7 = var / "matrices" / "epoch7.bin"
    made = subprocess.run(
        [sys.executable, "manage.py", "make_matrix", "--pages", "64", "--seed", "7", "--epoch-id",
         "7", "--out", str(epoch7)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300, check=False)
    assert made.returncode == 0, made.stderr
    bare = var / "matrices" / "bare.bin"  # no sidecar: nothing names its epoch
    bare.write_bytes(epoch7.read_bytes())
    unnamed = make("epoch", f"MATRIX={bare}", f"VAR={var}", env=env)
    assert unnamed.returncode != 0 and "no epoch id. Both parties must serve the same one: give " \
        "it with EPOCH_ID=N" in unnamed.stderr
    stopped = make("epoch", f"MATRIX={epoch7}", f"VAR={var}", env=env)
    assert stopped.returncode != 0 and "Traceback" not in stopped.stdout + stopped.stderr
    for party in "AB":
        assert f"party {party}: CommandError: epoch 7 was neither activated nor recorded: " \
            in stopped.stdout, stopped.stdout
    assert "both parties serve" not in stopped.stdout
    for party in "ab":
        with closing(sqlite3.connect(var / f"party-{party}.sqlite3")) as db:
            assert db.execute("SELECT count(*) FROM epochs_epoch WHERE epoch_id = 7").fetchone() == (0,)

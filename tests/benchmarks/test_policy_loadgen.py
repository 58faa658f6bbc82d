"""The Poisson load generators (engine and HTTP) and a live policy switch seen by a running server."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import loadgen, loadgen_http
from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
from tests.conftest import REPO, http_json, server_env


def test_poisson_arrivals_have_the_asked_rate_and_stay_in_the_span():
    arrivals = loadgen.poisson_arrivals(200.0, 30.0, np.random.default_rng(3))
    assert arrivals.min() >= 0 and arrivals.max() < 30
    assert len(arrivals) / 30 == pytest.approx(200, rel=0.05)
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps


def test_engine_sweep_writes_csv_with_header_and_judges_slo(tmp_path, capsys):
    points, shape = loadgen.sweep("cpu", pages=16, modes=("latency", "slo"), fractions=(0.5,),
                                  duration=0.8, warmup=0.2, window_us=2000, target_ms=None,
                                  max_batch=8, seed=2, log=lambda *a: None, capacity_s=0.5)
    assert [p.mode for p in points] == ["latency", "slo"]
    for point in points:
        assert point.answered > 0 and point.refused == 0
        assert 0 < point.p50_ms <= point.p95_ms <= point.p99_ms
        assert point.throughput_qps > 0
    assert shape["capacity_qps"] > 0 and shape["pages"] == 16
    header = loadgen.header_lines(shape, ["--pages", "16"])
    path = tmp_path / "points.csv"
    loadgen.write_csv(str(path), points, header)
    lines = path.read_text().splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["# machine", "# shape", "# command", "# date"]
    assert lines[2] == "# command: python3 benchmarks/loadgen.py --pages 16"
    again, _ = loadgen.read_csv(str(path))
    assert [p.mode for p in again] == ["latency", "slo"] and again[0].answered == points[0].answered
    assert loadgen.main(["--from-csv", str(path)]) == 0
    verdict = capsys.readouterr().out
    assert verdict.startswith(" 50%: p95 ") and "round-median p95" in verdict and "target" in verdict


@pytest.fixture
def party(tmp_path, start_server):
    """A runserver party over a 64-page matrix, on its own SQLite database."""
    matrix = tmp_path / "matrix.bin"
    write_matrix_file(matrix, 64, seed=5)
    write_epoch_metadata(matrix, epoch_id=9, block_number=1, state_root=bytes(32), seeds=(1, 2, 3))
    env = server_env(MORPHO_MATRIX_PATH=matrix, MORPHO_VAR_DIR=tmp_path, MORPHO_ENGINE_BACKEND="cpu",
                     DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}", MORPHO_LOG_LEVEL="WARNING")
    migrate = subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=180)
    assert migrate.returncode == 0, migrate.stderr
    return start_server("runserver", env), env


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_http_load_and_a_policy_switch_seen_by_the_server_within_a_second(party):
    server, env = party
    points, shape = loadgen_http.run(server.url, rates=[20.0], fractions=(), duration=1.5,
                                     warmup=0.3, clients=2, seed=4, log=lambda *a: None)
    assert points[0].mode == "latency:interactive-latency"
    assert points[0].answered > 10 and points[0].refused == 0 and shape["num_pages"] == 64
    # Another process activates the slo policy; the server's engine applies it within 1 s.
    writer = subprocess.run([sys.executable, "manage.py", "shell", "-c",
                             "import time; from policies.models import BatchingPolicy as P; "
                             "P.objects.get(name='interactive-slo').activate(); print(time.time())"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert writer.returncode == 0, writer.stderr
    committed = float(writer.stdout.strip().splitlines()[-1])
    while loadgen_http.active_policy(server.url)[0] != "interactive-slo":
        assert time.time() - committed < 1.0, "the server still applies the old policy after 1 s"
        time.sleep(0.02)
    status, _, body = http_json(server.url + "/health")
    assert status == 200

"""`gunicorn morphoweb.wsgi` given only MORPHO_MATRIX_PATH: migrates, starts, answers byte-exactly."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import REPO, VECTOR_EPOCH, http_json
from tests.protocol_vectors import ANSWER0_SHA256, ANSWER1_SHA256, KEY0_HEX, KEY1_HEX

pytestmark = pytest.mark.processes


def only(**values) -> dict:
    """An environment with nothing of ours in it but `values` (PATH kept to find programs)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    env.update({k: str(v) for k, v in values.items()})
    return env


def test_gunicorn_serves_the_vectors_given_only_the_matrix_path(start_server, vector_matrix_path):
    env = only(MORPHO_MATRIX_PATH=vector_matrix_path)
    migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stderr
    server = start_server("gunicorn", env)
    status, _, body = http_json(server.url + "/query/page/gpu", {"keys": [KEY0_HEX, KEY1_HEX, KEY0_HEX]})
    assert status == 200, body
    digests = [hashlib.sha256(bytes.fromhex(p[2:])).hexdigest() for p in body["pages"]]
    assert digests == [ANSWER0_SHA256, ANSWER1_SHA256, ANSWER0_SHA256]
    # The binary encoding through gunicorn: raw keys in, raw answers out, the epoch in a header.
    binary = urllib.request.Request(
        server.url + "/query/page/gpu", data=bytes.fromhex(KEY0_HEX + KEY1_HEX + KEY0_HEX),
        headers={"Content-Type": "application/octet-stream", "Accept": "application/octet-stream"})
    with urllib.request.urlopen(binary, timeout=60) as response:
        raw, epoch = response.read(), response.headers["X-Morpho-Epoch-Id"]
    assert [hashlib.sha256(raw[i * 4096:(i + 1) * 4096]).hexdigest() for i in range(3)] == digests
    assert len(raw) == 3 * 4096 and epoch == str(VECTOR_EPOCH["epoch_id"])
    status, _, health = http_json(server.url + "/health")
    # auto: no CUDA here (or there is, and then it is used); either way /health says which.
    assert status == 200 and health["backend"] in ("cpu", "cuda")
    if health["backend"] == "cpu":
        assert "CUDA" in health["fallback_reason"]
    assert "engine backend" in server.log()  # the start-up log names the backend chosen


def test_gunicorn_refuses_to_boot_without_its_matrix(start_server, tmp_path):
    missing = tmp_path / "missing.bin"
    server = start_server("gunicorn", only(MORPHO_MATRIX_PATH=missing), wait=False)
    assert server.wait_exit() != 0
    assert f"matrix file {missing} does not exist (MORPHO_MATRIX_PATH)" in server.log()


def test_cuda_backend_without_a_gpu_fails_at_start(start_server, vector_matrix_path):
    from tests.conftest import gpu_absent_reason

    if gpu_absent_reason() is None:
        pytest.skip("a GPU is present here: the cuda backend starts")
    env = only(MORPHO_MATRIX_PATH=vector_matrix_path, MORPHO_ENGINE_BACKEND="cuda")
    server = start_server("gunicorn", env, wait=False)
    assert server.wait_exit() != 0
    log = server.log()
    assert ("engine failed to start: the CUDA backend needs CuPy" in log
            or "engine failed to start: CuPy is installed but" in log), log[-2000:]

"""morpho-client installed on its own: a fresh virtualenv with ./pir and ./client, no Django,
Celery or CuPy, fetching rows from two real parties with its `morpho-client` command."""
from __future__ import annotations

import subprocess
import sys
import venv

import pytest

from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file
from tests.conftest import REPO, server_env

PAGES = 128  # 2,048 rows, domain_bits 7


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory):
    """A virtualenv holding morpho-pir and morpho-client and what they require, nothing more."""
    folder = tmp_path_factory.mktemp("client-venv")
    venv.create(folder, with_pip=True)
    done = subprocess.run([str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet",
                           str(REPO / "pir"), str(REPO / "client")],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def parties(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("package-parties")
    matrix = write_matrix_file(folder / "m.bin", PAGES, seed=9)
    write_epoch_metadata(matrix, epoch_id=3)
    envs = [server_env(MORPHO_MATRIX_PATH=matrix, MORPHO_ENGINE_BACKEND="cpu",
                       DATABASE_URL=f"sqlite:///{folder / name}.sqlite3") for name in "ab"]
    for env in envs:
        subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"], cwd=REPO,
                       env=env, check=True, timeout=300)
    return [start_server("runserver", env).url for env in envs], load_matrix(matrix)


def test_the_installed_client_needs_no_server_packages(client_venv):
    python = str(client_venv / "bin" / "python")
    for module in ("django", "celery", "cupy", "rest_framework", "gpu_engine", "queries"):
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                               text=True, cwd=client_venv)
        assert found.returncode == 1 and "ModuleNotFoundError" in found.stderr, module
    imported = subprocess.run(
        [python, "-c", "import sys, morpho_client, morpho_client.cli; "
                       "print(sorted(m.split('.')[0] for m in sys.modules))"],
        capture_output=True, text=True, cwd=client_venv, check=True)
    assert "httpx" in imported.stdout and "morpho_pir" in imported.stdout
    assert "django" not in imported.stdout


def test_the_installed_command_fetches_rows(client_venv, parties, tmp_path):
    (a, b), matrix = parties
    command = str(client_venv / "bin" / "morpho-client")
    rows = [0, 17, 2047, 1000]
    done = subprocess.run([command, "--server-a", a, "--server-b", b,
                           *[f"--row={r}" for r in rows], "--batch"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"row {r}: 0x{matrix.row(r).hex()}" for r in rows]
    # Many rows from a file, pipelined, to --out: every row as the matrix holds it.
    many = list(range(0, 2048, 7))
    (tmp_path / "rows.txt").write_text("\n".join(map(str, many)) + "\n")
    done = subprocess.run([command, "--server-a", a, "--server-b", b, "--rows", "rows.txt",
                           "--out", "rows.out", "--in-flight", "4"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == f"wrote {len(many)} rows to rows.out\n"
    assert (tmp_path / "rows.out").read_text().splitlines() == [
        f"row {r}: 0x{matrix.row(r).hex()}" for r in many]

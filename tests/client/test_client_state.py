"""Two real parties, one of which took a row update: the client refuses to XOR, never a wrong row.

docs/PROTOCOL.md section 6: every answer names its served state (the epoch and a digest of the
rows written over it); a client combines two parties' answers only when the states agree."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file
from morpho_client import PirClient, StateMismatch
from tests.conftest import REPO, http_json, server_env

pytestmark = pytest.mark.processes

ROW = 2 * 16 + 2  # a row of page 2, as in the finding: rows r % 16 == 2
DATA = bytes((7 * i + 1) % 256 for i in range(256))


@pytest.fixture(scope="module")
def two_parties(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("state")
    matrix = write_matrix_file(folder / "m.bin", 64, seed=3)
    write_epoch_metadata(matrix, epoch_id=21)
    envs = [server_env(MORPHO_MATRIX_PATH=matrix, MORPHO_ENGINE_BACKEND="cpu",
                       DATABASE_URL=f"sqlite:///{folder / name}.sqlite3") for name in "ab"]
    for env in envs:
        subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"], cwd=REPO,
                       env=env, check=True, timeout=300)
    urls = [start_server("runserver", env).url for env in envs]
    return urls, envs, load_matrix(matrix)


def push_row(env: dict) -> None:
    """An operator's row update, stored by another process; the party's server follows it."""
    subprocess.run([sys.executable, "manage.py", "shell", "-v0", "-c",
                    f"from epochs.sync import push_rows; push_rows([({ROW}, {DATA!r})])"],
                   cwd=REPO, env=env, check=True, timeout=300)


def wait_state(url: str, updates: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        state = http_json(url + "/epoch")[2]["state"]
        if state["updates"] == updates or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


@pytest.mark.parametrize("encoding", ["json", "binary"])
def test_a_row_update_on_one_party_is_refused_not_mixed(two_parties, encoding):
    (a, b), envs, matrix = two_parties
    if wait_state(a, 1)["updates"] == 0:  # the first run pushes A's update
        push_row(envs[0])
    state_a, state_b = wait_state(a, 1), wait_state(b, 0)
    assert state_a["updates"] == 1 and state_b["updates"] == 0
    assert state_a["epoch_id"] == state_b["epoch_id"] == 21 and state_a["digest"] != state_b["digest"]
    with PirClient(a, b, encoding=encoding, switch_deadline=0.5) as client:
        for row in (ROW, ROW + 16, 5):  # the updated row and rows it used to corrupt
            with pytest.raises(StateMismatch, match=r"different states: A \(.*\) epoch 21 with 1 row "
                                                    r"update \(digest 0x[0-9a-f]{64}\), B .* 0 row updates"):
                client.fetch_rows([row], batch=encoding == "binary")


def test_once_both_parties_took_it_the_row_comes_back_updated(two_parties):
    (a, b), envs, matrix = two_parties
    if wait_state(a, 1)["updates"] == 0:
        push_row(envs[0])
    push_row(envs[1])
    assert wait_state(b, 1) == wait_state(a, 1)  # same rows, same digest: one state
    with PirClient(a, b) as client:
        assert client.fetch_rows([ROW, ROW + 16, 5]) == [DATA, matrix.row(ROW + 16), matrix.row(5)]

"""Row updates and epoch switches made through one server process reach another within a second."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file
from tests.conftest import REPO, http_json, server_env

pytestmark = pytest.mark.processes

PAGES = 64


def _post(url, body, token):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Token {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())


@pytest.fixture(scope="module")
def party(tmp_path_factory, start_server):
    """Two server processes of one party: one database, one matrix file; and an operator token."""
    root = tmp_path_factory.mktemp("party")
    paths = {}
    for epoch_id in (1, 2):
        # in a folder of matrices alone: no epoch is recorded from one that holds the database
        paths[epoch_id] = write_matrix_file(root / "matrices" / f"e{epoch_id}.bin", PAGES,
                                            seed=epoch_id)
        write_epoch_metadata(paths[epoch_id], epoch_id=epoch_id, block_number=epoch_id * 10)
    env = server_env(DATABASE_URL=f"sqlite:///{root / 'db.sqlite3'}", MORPHO_MATRIX_PATH=paths[1],
                     MORPHO_ENGINE_BACKEND="cpu", MORPHO_VAR_DIR=root)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    script = (
        "from django.contrib.auth.models import Permission, User;"
        "from rest_framework.authtoken.models import Token;"
        "u = User.objects.create_user('op');"
        "u.user_permissions.set(Permission.objects.filter(content_type__app_label='epochs'));"
        "print(Token.objects.create(user=u).key)"
    )
    token = subprocess.run([sys.executable, "manage.py", "shell", "-c", script], cwd=REPO, env=env,
                           check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    a = start_server("runserver", env)
    b = start_server("runserver", env)
    return a, b, token, paths


def _answers(url, keys):
    status, _, body = http_json(url + "/query/page/gpu", {"keys": [k.to_bytes().hex() for k in keys]})
    assert status == 200, body
    return body["epoch_id"], [bytes.fromhex(p[2:]) for p in body["pages"]]


def _wait_for(url, keys, epoch_id, matrix, started, limit=1.0):
    expected = [e.tobytes() for e in reference_answers(matrix, KeyBatch.from_keys(keys))]
    while True:
        got_epoch, pages = _answers(url, keys)
        elapsed = time.monotonic() - started
        if got_epoch == epoch_id and pages == expected:
            return elapsed
        assert elapsed < limit, f"{url} still answers epoch {got_epoch} without the change after {elapsed:.2f} s"
        time.sleep(0.02)


def test_update_and_switch_reach_the_other_process_within_a_second(party):
    a, b, token, paths = party
    rng = np.random.default_rng(5)
    keys = [gen_keys(p, 6, rng=rng)[0] for p in (3, 9, 3)]
    data = bytes(range(256))
    started = time.monotonic()
    status, body = _post(a.url + "/api/row-updates/", {"row": 3 * 16 + 4, "data": data.hex()}, token)
    assert status == 201 and body["epoch_id"] == 1
    matrix = load_matrix(paths[1])
    matrix.write_row(3 * 16 + 4, data)
    # The process that acknowledged it answers with it at once; the other within a second.
    assert _answers(a.url, keys)[1] == [e.tobytes() for e in reference_answers(matrix, KeyBatch.from_keys(keys))]
    assert _wait_for(b.url, keys, 1, matrix, started) < 1.0

    status, record = _post(a.url + "/api/epochs/", {"epoch_id": 2, "matrix_path": str(paths[2]),
                                                    "pending_updates": "absorb"}, token)
    assert status == 201, record
    started = time.monotonic()
    status, record = _post(a.url + f"/api/epochs/{record['id']}/activate/", {}, token)
    assert status == 200 and record["state"] == "active"
    matrix = load_matrix(paths[2])
    matrix.write_row(3 * 16 + 4, data)  # absorbed: still in force on epoch 2
    assert _wait_for(b.url, keys, 2, matrix, started) < 1.0
    assert http_json(b.url + "/epoch")[2]["epoch_id"] == 2

"""A matrix file changed under the server never changes what one epoch_id serves: the size and
SHA-256 recorded with each epoch are checked at every load, and the pages served are a private
copy, so overwriting or truncating the file neither changes answers nor kills the server."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error

import numpy as np
import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from rest_framework.test import APIClient

import gpu_engine.matrix as matrix_module
from epochs.models import Epoch
from morpho_pir.dpf import gen_keys
from gpu_engine.matrix import (
    PAGE_BYTES,
    MatrixChanged,
    load_epoch,
    load_matrix,
    metadata_path,
    write_epoch_metadata,
    write_matrix_file,
)
from engine.holder import get_engine
from tests.conftest import REPO, http_json, server_env

PAGES = 64  # domain_bits 6


def overwrite_in_place(path, seed: int) -> None:
    """New bytes into the same file (same inode), as `cp other.bin path` or `dd` would."""
    fresh = np.random.default_rng(seed).integers(0, 256, path.stat().st_size, dtype=np.uint8)
    with open(path, "r+b") as fh:
        fh.write(fresh.tobytes())


def test_the_sidecar_records_size_and_digest_and_every_load_checks_them(tmp_path):
    path = write_matrix_file(tmp_path / "m.bin", PAGES, seed=1)
    write_epoch_metadata(path, epoch_id=3)
    meta = json.loads(metadata_path(path).read_text())
    assert meta["size_bytes"] == PAGES * PAGE_BYTES
    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_epoch(path).matrix.sha256 == meta["sha256"]
    overwrite_in_place(path, seed=2)
    with pytest.raises(MatrixChanged, match=f"changed since its epoch was recorded: sha256 "
                                            f"[0-9a-f]{{64}}, expected {meta['sha256']}"):
        load_epoch(path)
    with open(path, "r+b") as fh:
        fh.truncate(PAGES * PAGE_BYTES // 2)
    with pytest.raises(MatrixChanged, match=f"{PAGES * PAGE_BYTES // 2} bytes, expected "
                                            f"{PAGES * PAGE_BYTES}"):
        load_epoch(path)


def test_pages_are_a_private_copy_of_the_bytes_that_were_hashed(tmp_path):
    path = write_matrix_file(tmp_path / "m.bin", PAGES, seed=1)
    original = path.read_bytes()
    matrix = load_matrix(path)
    overwrite_in_place(path, seed=2)
    assert b"".join(matrix.page(i) for i in range(PAGES)) == original
    assert matrix.sha256 == hashlib.sha256(original).hexdigest()


def test_large_files_log_their_progress(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(matrix_module, "LOG_PROGRESS_BYTES", PAGE_BYTES)
    monkeypatch.setattr(matrix_module, "READ_CHUNK_BYTES", 16 * PAGE_BYTES)
    path = write_matrix_file(tmp_path / "m.bin", PAGES, seed=1)
    seen = []
    load_matrix(path, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(n * 16 * PAGE_BYTES, PAGES * PAGE_BYTES) for n in (1, 2, 3, 4)]
    with caplog.at_level(logging.INFO, logger="gpu_engine.matrix"):
        load_matrix(path)
    assert "reading and hashing matrix file" in caplog.text
    assert "100% (0.0 of 0.0 GiB)" in caplog.text


# --- epoch records --------------------------------------------------------------------------------


@pytest.fixture
def operator(db):
    user = User.objects.create_user("operator")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="epochs"))
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def files(tmp_path, serve_matrix, db):
    served = write_matrix_file(tmp_path / "epoch1.bin", PAGES, seed=1)
    write_epoch_metadata(served, epoch_id=1)
    serve_matrix(served)
    get_engine()
    following = write_matrix_file(tmp_path / "epoch2.bin", PAGES, seed=2)
    write_epoch_metadata(following, epoch_id=2)
    return {"served": served, "next": following}


def test_a_record_carries_the_files_size_and_digest(files, operator):
    path = files["next"]
    body = operator.post("/api/epochs/", {"epoch_id": 2, "matrix_path": str(path)},
                         format="json").json()
    assert body["size_bytes"] == PAGES * PAGE_BYTES
    assert body["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()  # the sidecar's


def _refusal(operator, path, epoch_id=3) -> str:
    response = operator.post("/api/epochs/", {"epoch_id": epoch_id, "matrix_path": str(path)},
                             format="json")
    assert response.status_code == 400, response.content
    (error,) = [e for e in response.json()["errors"] if e["field"] == "matrix_path"]
    return error["message"]


def test_a_file_without_a_sidecar_is_no_matrix(files, operator):
    database = files["served"].parent / "party-a.sqlite3"  # what an epoch once published
    database.write_bytes(b"SQLite format 3\x00" + bytes(PAGE_BYTES * 2))
    message = _refusal(operator, database)
    assert "is not described as a matrix: expected its sidecar" in message
    assert f"python manage.py describe_matrix {database}" in message
    assert not Epoch.objects.filter(epoch_id=3).exists()


@pytest.mark.parametrize("change, words", [
    ({"size_bytes": PAGES * PAGE_BYTES + 1}, "records size_bytes"),
    ({"sha256": None}, "records no sha256"),
    ({"page_size_bytes": 1024}, "records page_size_bytes 1024, expected 4096"),
    ({"num_pages": PAGES + 1}, f"records num_pages {PAGES + 1}, the file holds {PAGES}"),
])
def test_a_sidecar_must_describe_the_file_as_pages(files, operator, change, words):
    sidecar = metadata_path(files["next"])
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), **change}))
    assert words in _refusal(operator, files["next"])


def test_describe_matrix_writes_the_sidecar_an_epoch_needs(files, operator):
    metadata_path(files["next"]).unlink()
    assert "expected its sidecar" in _refusal(operator, files["next"])
    call_command("describe_matrix", str(files["next"]), stdout=io.StringIO())
    body = operator.post("/api/epochs/", {"epoch_id": 3, "matrix_path": str(files["next"])},
                         format="json").json()
    assert body["sha256"] == hashlib.sha256(files["next"].read_bytes()).hexdigest()


def test_a_matrix_directory_that_holds_the_partys_files_takes_no_epochs(files, operator, settings):
    folder = files["served"].parent
    databases = settings.DATABASES
    settings.DATABASES = {**databases, "default": {
        **settings.DATABASES["default"], "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(folder / "db.sqlite3")}}
    message = _refusal(operator, files["next"])
    assert f"the matrix directory {folder} (MORPHO_MATRIX_DIR" in message
    assert f"holds the database (DATABASE_URL), {folder / 'db.sqlite3'}" in message
    settings.DATABASES = databases
    settings.VAR_DIR = folder / "var"  # the state folder below the matrices (above is no harm)
    assert "holds the state folder (MORPHO_VAR_DIR)" in _refusal(operator, files["next"])
    settings.VAR_DIR = folder.parent
    assert operator.post("/api/epochs/", {"epoch_id": 3, "matrix_path": str(files["next"])},
                         format="json").status_code == 201


def test_an_epoch_whose_file_changed_is_not_activated(files, operator):
    record = operator.post("/api/epochs/", {"epoch_id": 2, "matrix_path": str(files["next"])},
                           format="json").json()
    overwrite_in_place(files["next"], seed=9)
    response = operator.post(f"/api/epochs/{record['id']}/activate/", {}, format="json")
    assert response.status_code == 409
    assert f"changed since its epoch was recorded: sha256" in response.json()["detail"]
    assert f"expected {record['sha256']}" in response.json()["detail"]
    assert get_engine().epoch.epoch_id == 1


def test_a_record_from_before_digests_is_pinned_by_its_first_load(files):
    record = Epoch(epoch_id=2, matrix_path=str(files["next"]))
    record.full_clean()
    Epoch.objects.bulk_create([record])
    Epoch.objects.filter(epoch_id=2).update(sha256="", size_bytes=None)  # as migrated
    legacy = Epoch.objects.get(epoch_id=2)
    epoch = legacy.load()
    assert Epoch.objects.get(epoch_id=2).sha256 == epoch.matrix.sha256
    overwrite_in_place(files["next"], seed=9)
    with pytest.raises(MatrixChanged, match="changed since its epoch was recorded"):
        Epoch.objects.get(epoch_id=2).load()


# --- a real server whose file is overwritten, then truncated, then restarted ----------------------


def private_read(url: str, page: int, rng) -> tuple[int, bytes]:
    """Both key shares sent to the one server: their answers XOR to the page it serves."""
    key0, key1 = gen_keys(page, 6, rng=rng)
    other = gen_keys(0, 6, rng=rng)[0].to_bytes().hex()
    pages = []
    for key in (key0, key1):
        status, _, body = http_json(url + "/query/page/gpu",
                                    {"keys": [key.to_bytes().hex(), other, other]})
        assert status == 200, body
        pages.append(bytes.fromhex(body["pages"][0][2:]))
    return body["epoch_id"], bytes(a ^ b for a, b in zip(*pages))


@pytest.fixture(scope="module")
def party(tmp_path_factory):
    var = tmp_path_factory.mktemp("integrity-var")
    path = write_matrix_file(var / "matrix.bin", PAGES, seed=1)
    write_epoch_metadata(path, epoch_id=1)
    env = server_env(MORPHO_MATRIX_PATH=path, MORPHO_ENGINE_BACKEND="cpu", MORPHO_VAR_DIR=var,
                     DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}", MORPHO_ENGINE_RETRY_AFTER=1)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                   check=True)
    return path, env


@pytest.mark.processes
def test_overwriting_or_truncating_the_served_file_changes_nothing_served(start_server, party):
    path, env = party
    original = path.read_bytes()
    server = start_server("gunicorn", env)
    rng = np.random.default_rng(5)
    wanted = [original[p * PAGE_BYTES:(p + 1) * PAGE_BYTES] for p in (7, 40)]
    assert [private_read(server.url, p, rng) for p in (7, 40)] == [(1, w) for w in wanted]
    overwrite_in_place(path, seed=2)
    assert [private_read(server.url, p, rng) for p in (7, 40)] == [(1, w) for w in wanted]
    with open(path, "r+b") as fh:  # a mapping of the file would now fault (SIGBUS) on page 40
        fh.truncate(PAGES * PAGE_BYTES // 2)
    assert [private_read(server.url, p, rng) for p in (7, 40)] == [(1, w) for w in wanted]
    assert server.proc.poll() is None and "SIGBUS" not in server.log()


@pytest.mark.processes
def test_a_restarted_server_refuses_a_changed_file_with_the_reason(start_server, party):
    path, env = party
    assert path.stat().st_size != PAGES * PAGE_BYTES  # changed by the test above
    eager = start_server("gunicorn", env, wait=False)
    assert eager.wait_exit() != 0
    assert "changed since its epoch was recorded" in eager.log()
    lazy = start_server("gunicorn", {**env, "MORPHO_ENGINE_EAGER": "false"}, wait=False)
    deadline = time.monotonic() + 90
    while True:
        try:
            status, headers, body = http_json(lazy.url + "/health", timeout=5)
            break
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline, lazy.log()[-3000:]
            time.sleep(0.3)
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert "changed since its epoch was recorded" in body["detail"]
    assert f"{os.path.getsize(path)} bytes, expected {PAGES * PAGE_BYTES}" in body["detail"]
    status, _, body = http_json(lazy.url + "/query/page/gpu", {"keys": ["00", "00", "00"]})
    assert status == 503 and "changed since its epoch was recorded" in body["detail"]

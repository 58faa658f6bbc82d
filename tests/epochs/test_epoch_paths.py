"""Epoch matrix files come only from the matrix directory: every escape is refused, in the same
words whether or not the file outside exists, by the API, the admin and load_epoch alike."""
from __future__ import annotations

import os

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from epochs.models import Epoch
from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
from engine.holder import get_engine

PAGES = 16
SECRET = b"root:$6$not-a-real-hash:19000:0:99999:7:::\n" * 100  # 4,300 bytes of "secrets"


@pytest.fixture
def layout(tmp_path, settings, serve_matrix, db):
    """matrices/ (the matrix directory, served epoch 1) beside outside/ (a secret file)."""
    inside = tmp_path / "matrices"
    outside = tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    served = write_matrix_file(inside / "epoch1.bin", PAGES, seed=1)
    write_epoch_metadata(served, epoch_id=1)
    write_epoch_metadata(write_matrix_file(inside / "epoch2.bin", PAGES, seed=2), epoch_id=2)
    secret = outside / "shadow"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    os.symlink(secret, inside / "link-out.bin")
    os.symlink(outside / "missing", inside / "dangling-out.bin")
    os.symlink(outside, inside / "folder-out")
    os.symlink(inside / "epoch2.bin", inside / "link-in.bin")
    serve_matrix(served, MORPHO_MATRIX_DIR=inside)
    get_engine()
    return {"inside": inside, "outside": outside, "secret": secret}


@pytest.fixture
def operator():
    user = User.objects.create_user("operator")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="epochs"))
    client = APIClient()
    client.force_authenticate(user)
    return client


def escapes(layout):
    inside, outside = layout["inside"], layout["outside"]
    return {
        "absolute path outside, file exists": str(layout["secret"]),
        "absolute path outside, no such file": str(outside / "missing"),
        "the system's shadow file": "/etc/shadow",
        "a system file that does not exist": "/etc/no-such-file-here",
        "'..' from inside": str(inside / ".." / "outside" / "shadow"),
        "'..' relative": "../outside/shadow",
        "'..' that comes back inside": str(inside / ".." / "matrices" / "epoch2.bin"),
        "symlink inside to a file outside": str(inside / "link-out.bin"),
        "symlink inside to nothing outside": str(inside / "dangling-out.bin"),
        "symlinked folder inside, file outside": str(inside / "folder-out" / "shadow"),
        "symlinked folder inside, no file": str(inside / "folder-out" / "missing"),
        "the directory itself": str(inside),
    }


def _shape(message: str, given: str) -> str:
    return message.replace(repr(given), "<given>")


def test_every_escape_is_refused_in_one_message_that_reveals_nothing(layout, operator):
    shapes = set()
    for case, given in escapes(layout).items():
        response = operator.post("/api/epochs/", {"epoch_id": 9, "matrix_path": given},
                                 format="json")
        assert response.status_code == 400, (case, response.content)
        errors = [e for e in response.json()["errors"] if e["field"] == "matrix_path"]
        assert len(errors) == 1, (case, response.json())
        message = errors[0]["message"]
        assert f"expected a file inside the matrix directory {layout['inside']}" in message, case
        shapes.add(_shape(message, given))
        # Nothing about the file outside: not its size, not whether it is there.
        assert str(len(SECRET)) not in message and "no matrix file" not in message, case
        assert "empty" not in message and "regular" not in message, case
    assert len(shapes) == 1, shapes
    # none was recorded (the served file is, once the engine starts: it is inside the directory)
    assert not Epoch.objects.filter(epoch_id=9).exists()


def test_the_admin_refuses_an_escape_in_the_same_words(layout, client):
    User.objects.create_superuser("root", password="pw-root")
    client.login(username="root", password="pw-root")
    given = str(layout["inside"] / "link-out.bin")
    response = client.post("/admin/epochs/epoch/add/", {
        "epoch_id": 9, "matrix_path": given, "block_number": 0, "state_root": "00" * 32,
        "seeds": "[1, 2, 3]", "pending_updates": "absorb", "switch_mode": "beside",
        "placement": "auto"})
    assert response.status_code == 200
    text = response.content.decode().replace("&#x27;", "'")
    assert f"expected a file inside the matrix directory {layout['inside']}" in text
    assert not Epoch.objects.filter(epoch_id=9).exists()


def test_load_epoch_refuses_an_escape_before_reading_its_sidecar(layout):
    # A sidecar beside the secret would otherwise be read (and its parse error echoed).
    (layout["outside"] / "shadow.epoch.json").write_text("not json")
    with pytest.raises(CommandError, match="expected a file inside the matrix directory"):
        call_command("load_epoch", str(layout["secret"]), "--epoch-id", "9")
    assert not Epoch.objects.filter(epoch_id=9).exists()


def test_paths_inside_are_accepted_and_stored_resolved(layout, operator):
    inside = layout["inside"]
    for epoch_id, given, stored in ((2, "epoch2.bin", inside / "epoch2.bin"),
                                    (3, str(inside / "link-in.bin"), inside / "epoch2.bin"),
                                    (4, str(inside / "." / "epoch1.bin"), inside / "epoch1.bin")):
        response = operator.post("/api/epochs/", {"epoch_id": epoch_id, "matrix_path": given},
                                 format="json")
        assert response.status_code == 201, response.content
        assert response.json()["matrix_path"] == str(stored)
        assert response.json()["num_pages"] == PAGES
    missing = operator.post("/api/epochs/", {"epoch_id": 5, "matrix_path": "nope.bin"},
                            format="json")
    assert missing.status_code == 400
    assert f"no matrix file at '{inside / 'nope.bin'}'" in missing.json()["detail"]


def test_a_file_swapped_for_a_symlink_out_after_recording_is_not_loaded(layout, operator):
    inside = layout["inside"]
    record = operator.post("/api/epochs/", {"epoch_id": 2, "matrix_path": "epoch2.bin"},
                           format="json").json()
    (inside / "epoch2.bin").unlink()
    os.symlink(layout["secret"], inside / "epoch2.bin")
    response = operator.post(f"/api/epochs/{record['id']}/activate/", {}, format="json")
    assert response.status_code == 409
    assert "expected a file inside the matrix directory" in response.json()["detail"]
    assert get_engine().epoch.epoch_id == 1  # still serving the epoch it had
    assert APIClient().get("/epoch").json()["num_rows"] == PAGES * 16

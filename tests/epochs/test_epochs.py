"""Epoch records and row updates through the API, the admin and the load_epoch command."""
from __future__ import annotations

import numpy as np
import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from epochs.models import Epoch, EpochState, RowUpdate, UpdateState
from gpu_engine.backends.cpu import reference_answers
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.matrix import ROW_BYTES, load_matrix, write_epoch_metadata, write_matrix_file
from engine.holder import get_engine

PAGES = 64  # 1024 rows, domain_bits 6


@pytest.fixture
def matrices(tmp_path):
    """Three matrix files: the one served at start (epoch 1) and two later epochs."""
    paths = {}
    for epoch_id, seed in ((1, 11), (2, 22), (3, 33)):
        path = write_matrix_file(tmp_path / f"epoch{epoch_id}.bin", PAGES, seed=seed)
        write_epoch_metadata(path, epoch_id=epoch_id, block_number=100 * epoch_id,
                             state_root=bytes([epoch_id]) * 32, seeds=(epoch_id, 7, 9))
        paths[epoch_id] = path
    return paths


@pytest.fixture
def served(db, serve_matrix, matrices):
    serve_matrix(matrices[1])
    return get_engine()


@pytest.fixture
def operator(db):
    user = User.objects.create_user("operator", password="pw-operator")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="epochs"))
    client = APIClient()
    client.force_authenticate(user)
    return client


def row_bytes(value: int) -> bytes:
    return bytes((value + i) % 256 for i in range(ROW_BYTES))


def expected_page(path, updates, page):
    """Page `page` of the matrix file with `updates` ({row: bytes}) written over it."""
    matrix = load_matrix(path)
    for row, data in updates.items():
        matrix.write_row(row, data)
    return matrix.page(page)


def fetch_page(client, page, domain_bits=6, rng=None):
    """One private read through the API, both parties' answers computed against the same server."""
    rng = rng or np.random.default_rng(page)
    key0, key1 = gen_keys(page, domain_bits, rng=rng)
    others = [gen_keys(p, domain_bits, rng=rng)[0] for p in (0, 1)]
    answers = []
    for key in (key0, key1):
        body = {"keys": [key.to_bytes().hex(), others[0].to_bytes().hex(), others[1].to_bytes().hex()]}
        response = client.post("/query/page/gpu", body, format="json")
        assert response.status_code == 200, response.content
        answers.append(response.json())
    assert answers[0]["epoch_id"] == answers[1]["epoch_id"]
    a0 = bytes.fromhex(answers[0]["pages"][0][2:])
    a1 = bytes.fromhex(answers[1]["pages"][0][2:])
    return answers[0]["epoch_id"], bytes(x ^ y for x, y in zip(a0, a1))


def test_row_update_is_in_every_answer_after_the_201(served, operator, matrices):
    data = row_bytes(5)
    response = operator.post("/api/row-updates/", {"row": 37, "data": "0x" + data.hex()}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["epoch_id"] == 1 and body["row"] == 37 and body["state"] == "pending"
    assert RowUpdate.objects.get(pk=body["id"]).data == "0x" + data.hex()
    epoch_id, page = fetch_page(APIClient(), 37 // 16)
    assert epoch_id == 1
    assert page == expected_page(matrices[1], {37: data}, 2)
    assert page[5 * ROW_BYTES:6 * ROW_BYTES] == data


@pytest.mark.parametrize(
    "body, field, message",
    [
        ({"row": 1024, "data": "00" * 256}, "row", "row 1024 is outside epoch 1's rows 0..1023"),
        ({"row": 3, "data": "00" * 255}, "data", "expected 256 bytes (512 hex digits), got 510"),
        ({"row": 3, "data": "zz" * 256}, "data", "expected hex digits 0-9a-f, got 'z' at position 0"),
    ],
)
def test_bad_row_update_is_a_400_in_the_models_words(served, operator, body, field, message):
    response = operator.post("/api/row-updates/", body, format="json")
    assert response.status_code == 400
    assert message in str(response.json())
    assert field in str(response.json())
    assert not RowUpdate.objects.exists()


def test_admin_rejects_the_same_bad_row_with_the_same_words(served, client, matrices):
    User.objects.create_superuser("root", password="pw-root")
    client.login(username="root", password="pw-root")
    response = client.post("/admin/epochs/rowupdate/add/", {"row": 1024, "data": "00" * 256})
    assert response.status_code == 200
    assert "row 1024 is outside epoch 1&#x27;s rows 0..1023" in response.content.decode()
    data = row_bytes(9)
    response = client.post("/admin/epochs/rowupdate/add/", {"row": 2, "data": data.hex()})
    assert response.status_code == 302
    assert fetch_page(APIClient(), 0)[1][2 * ROW_BYTES:3 * ROW_BYTES] == data


def test_epoch_record_validation_names_the_bad_value(served, operator, tmp_path):
    response = operator.post("/api/epochs/", {
        "epoch_id": 9, "matrix_path": str(tmp_path / "nope.bin"), "state_root": "0x12",
    }, format="json")
    assert response.status_code == 400
    text = str(response.json())
    assert f"no matrix file at '{tmp_path / 'nope.bin'}'" in text
    assert "state_root '0x12': expected 32 bytes (64 hex digits), got 2 hex digits" in text


@pytest.mark.parametrize("mode", ["absorb", "discard"])
def test_activating_an_epoch_absorbs_or_discards_pending_updates(served, operator, matrices, mode):
    data = row_bytes(1)
    assert operator.post("/api/row-updates/", {"row": 20, "data": data.hex()}, format="json").status_code == 201
    created = operator.post("/api/epochs/", {
        "epoch_id": 2, "matrix_path": str(matrices[2]), "block_number": 200,
        "state_root": "02" * 32, "seeds": [2, 7, 9], "pending_updates": mode,
    }, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["num_pages"] == PAGES and created.json()["state"] == "loaded"
    activated = operator.post(f"/api/epochs/{created.json()['id']}/activate/", {}, format="json")
    assert activated.status_code == 200, activated.content
    assert activated.json()["state"] == "active"
    epoch = APIClient().get("/epoch").json()
    assert (epoch["epoch_id"], epoch["block_number"], epoch["seeds"]) == (2, 200, [2, 7, 9])
    assert epoch["state_root"] == "0x" + "02" * 32
    epoch_id, page = fetch_page(APIClient(), 1)
    assert epoch_id == 2
    kept = {20: data} if mode == "absorb" else {}
    assert page == expected_page(matrices[2], kept, 1)
    update = RowUpdate.objects.get()
    assert (update.epoch_id, update.first_epoch_id, update.state) == (
        (2, 1, UpdateState.PENDING) if mode == "absorb" else (1, 1, UpdateState.DISCARDED))


def test_operations_need_an_authorised_user(served, matrices):
    anonymous = APIClient()
    assert anonymous.post("/api/row-updates/", {"row": 1, "data": "00" * 256}, format="json").status_code in (401, 403)
    assert anonymous.get("/api/epochs/").status_code in (401, 403)
    nobody = User.objects.create_user("nobody", password="pw")
    signed_in = APIClient()
    signed_in.force_authenticate(nobody)
    response = signed_in.post("/api/row-updates/", {"row": 1, "data": "00" * 256}, format="json")
    assert response.status_code == 403
    assert not RowUpdate.objects.exists()
    viewer = User.objects.create_user("viewer", password="pw")
    viewer.user_permissions.set(Permission.objects.filter(codename__in=["view_epoch", "add_epoch"]))
    record = Epoch.objects.create(epoch_id=2, matrix_path=str(matrices[2]), num_pages=PAGES)
    signed_in.force_authenticate(viewer)
    assert signed_in.post(f"/api/epochs/{record.pk}/activate/", {}, format="json").status_code == 403
    assert get_engine().epoch.epoch_id == 1


def test_load_epoch_command_reads_the_sidecar_and_activates(served, matrices, capsys):
    call_command("load_epoch", str(matrices[3]), "--activate", "--discard-updates")
    record = Epoch.objects.get(epoch_id=3)
    assert (record.block_number, record.seeds, record.state) == (300, [3, 7, 9], EpochState.ACTIVE)
    assert record.state_root == "0x" + "03" * 32
    assert get_engine().epoch.epoch_id == 3
    assert "epoch 3 is active" in capsys.readouterr().out
    with pytest.raises(CommandError, match="epoch_id: epoch_id 3 is already recorded"):
        call_command("load_epoch", str(matrices[3]))


def test_load_epoch_command_rejects_a_missing_file(served, tmp_path):
    with pytest.raises(CommandError, match="matrix_path: no matrix file at"):
        call_command("load_epoch", str(tmp_path / "missing.bin"), "--epoch-id", "4")


def test_engine_started_later_serves_the_active_epoch_with_its_updates(db, serve_matrix, matrices):
    serve_matrix(matrices[1])
    record = Epoch(epoch_id=2, matrix_path=str(matrices[2]))
    record.full_clean()
    record.state = EpochState.ACTIVE
    record.save()
    data = row_bytes(77)
    RowUpdate.objects.create(epoch_id=2, first_epoch_id=2, row=100, data="0x" + data.hex())
    # A fresh process (here: a fresh engine) must start on epoch 2 with row 100 already written.
    epoch_id, page = fetch_page(APIClient(), 100 // 16)
    assert epoch_id == 2
    assert page == expected_page(matrices[2], {100: data}, 100 // 16)


def test_answers_match_the_reference_for_the_named_epoch(served, operator, matrices):
    # The reference check the hammer test relies on, once, without threads.
    rng = np.random.default_rng(4)
    keys = [gen_keys(int(p), 6, rng=rng)[0] for p in rng.integers(0, PAGES, 3)]
    body = {"keys": [k.to_bytes().hex() for k in keys]}
    answer = APIClient().post("/query/page/gpu", body, format="json").json()
    expected = reference_answers(load_matrix(matrices[1]), KeyBatch.from_keys(keys))
    assert [bytes.fromhex(p[2:]) for p in answer["pages"]] == [e.tobytes() for e in expected]


def test_load_epoch_from_a_process_without_an_engine_is_followed_at_engine_start(db, serve_matrix, matrices):
    # `manage.py load_epoch --activate` runs beside the servers: it only records the switch.
    from engine.holder import peek_engine, shutdown_engine

    shutdown_engine()
    serve_matrix(matrices[1])
    call_command("load_epoch", str(matrices[2]), "--activate")
    assert peek_engine() is None
    assert Epoch.objects.active().epoch_id == 2
    assert get_engine().epoch.epoch_id == 2


def test_switch_to_a_larger_epoch_changes_the_domain_clients_see(served, operator, tmp_path):
    path = write_matrix_file(tmp_path / "big.bin", 4 * PAGES, seed=44)  # 256 pages: domain_bits 8
    write_epoch_metadata(path, epoch_id=7)
    data = row_bytes(3)
    assert operator.post("/api/row-updates/", {"row": 1000, "data": data.hex()}, format="json").status_code == 201
    record = operator.post("/api/epochs/", {"epoch_id": 7, "matrix_path": str(path)}, format="json").json()
    assert operator.post(f"/api/epochs/{record['id']}/activate/", {}, format="json").status_code == 200
    epoch = APIClient().get("/epoch").json()
    assert (epoch["epoch_id"], epoch["num_rows"], epoch["page_pir"]["domain_bits"]) == (7, 4096, 8)
    epoch_id, page = fetch_page(APIClient(), 1000 // 16, domain_bits=8)
    assert epoch_id == 7 and page == expected_page(path, {1000: data}, 1000 // 16)
    # A client still holding keys for the old domain is told what changed, not answered wrongly.
    old_keys = [gen_keys(1, 6)[0].to_bytes().hex() for _ in range(3)]
    response = APIClient().post("/query/page/gpu", {"keys": old_keys}, format="json")
    assert response.status_code == 400 and "domain_bits: expected 8" in response.json()["detail"]


def test_listings_are_paged_newest_first(served, operator):
    from epochs import sync

    sync.push_rows([(row, row_bytes(row)) for row in range(5)])
    page = operator.get("/api/row-updates/?limit=2").json()
    assert page["count"] == 5 and [u["row"] for u in page["results"]] == [4, 3]
    assert "offset=2" in page["next"]


def test_admin_records_and_activates_an_epoch(served, client, matrices):
    User.objects.create_superuser("root", password="pw-root")
    client.login(username="root", password="pw-root")
    assert client.get("/admin/epochs/epoch/add/").status_code == 200
    response = client.post("/admin/epochs/epoch/add/", {
        "epoch_id": 3, "matrix_path": str(matrices[3]), "block_number": 300, "state_root": "03" * 32,
        "seeds": "[3, 7, 9]", "pending_updates": "discard", "switch_mode": "beside",
        "placement": "auto"})
    assert response.status_code == 302, response.content.decode()[:2000]
    record = Epoch.objects.get(epoch_id=3)
    assert record.num_pages == PAGES and record.state_root == "0x" + "03" * 32
    bad = client.post("/admin/epochs/epoch/add/", {
        "epoch_id": 4, "matrix_path": "nowhere.bin", "block_number": 0, "state_root": "00" * 32,
        "seeds": "[1, 2]", "pending_updates": "absorb", "switch_mode": "beside",
        "placement": "auto"})
    text = bad.content.decode()
    missing = matrices[3].parent / "nowhere.bin"  # a relative path is taken from the matrix directory
    assert f"no matrix file at &#x27;{missing}&#x27;" in text and "expected three integers" in text
    response = client.post("/admin/epochs/epoch/", {"action": "activate_beside",
                                                    "_selected_action": [record.pk]}, follow=True)
    assert "Epoch 3 is active" in response.content.decode()
    assert APIClient().get("/epoch").json()["block_number"] == 300

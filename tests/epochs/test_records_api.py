"""A records epoch served: /epoch publishes its table, queries carry its fingerprint, and
/api/records/ sets and deletes keys as row updates (docs/PROTOCOL.md sections 5.6 and 9)."""
from __future__ import annotations

import numpy as np
import pytest
from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from engine.holder import get_engine
from epochs.models import Epoch, RecordChange, RowUpdate
from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
from gpu_engine.records import build
from morpho_pir.dpf import gen_keys
from morpho_pir.protocol import PAGE_BYTES, ROWS_PER_PAGE
from morpho_pir.records import RecordsTable
from tests.morpho_pir.test_records import random_records

HEADER = "HTTP_X_MORPHO_RECORDS_FINGERPRINT"


def write_records_epoch(folder, count: int, num_pages=None, seed: int = 4):
    keys, values, types = random_records(count, key_bytes=20, value_bytes=40, seed=seed)
    built = build(keys, values, types, seed=seed, num_pages=num_pages)
    path = folder / "records.bin"
    built.rows.tofile(path)
    write_epoch_metadata(path, epoch_id=7, records=built.table)
    return path, built, keys, values


@pytest.fixture
def records_epoch(db, serve_matrix, tmp_path):
    path, built, keys, values = write_records_epoch(tmp_path, 1500)
    serve_matrix(path)
    get_engine()
    return built, keys, values


@pytest.fixture
def operator(db):
    user = User.objects.create_user("operator", password="pw-operator")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="epochs"))
    client = APIClient()
    client.force_authenticate(user)
    return client


def lookup(table: RecordsTable, key: bytes, fingerprint: str | None = None):
    """One private lookup against this process's server, both keys of each pair sent to it."""
    client = APIClient()
    pages = table.candidate_pages(key)
    domain_bits = max(1, (table.num_pages - 1).bit_length())
    rng = np.random.default_rng(1)
    pairs = [gen_keys(page, domain_bits, rng=rng) for page in pages]
    extra = {HEADER: fingerprint or table.fingerprint_hex}
    answers = []
    for party in (0, 1):
        body = {"keys": [pair[party].to_bytes().hex() for pair in pairs]}
        response = client.post("/query/page/gpu", body, format="json", **extra)
        assert response.status_code == 200, response.content
        answers.append([bytes.fromhex(page[2:]) for page in response.json()["pages"]])
    got = [bytes(a ^ b for a, b in zip(x, y)) for x, y in zip(*answers)]
    assert all(len(page) == PAGE_BYTES for page in got)
    return table.find(key, got)


def test_epoch_publishes_the_table_and_lookups_find_present_keys_not_absent_ones(records_epoch):
    built, keys, values = records_epoch
    body = APIClient().get("/epoch").json()
    assert body["records"] == built.table.describe()
    assert body["records"]["num_pages"] == body["page_pir"]["num_pages"]
    assert Epoch.objects.active().records == built.table.describe()
    for index in (0, 777, 1499):
        assert lookup(built.table, keys[index].tobytes()).value == values[index].tobytes()
    assert lookup(built.table, b"\x01" * 20) is None


def test_a_lookup_made_for_other_parameters_is_refused_naming_the_fingerprint(records_epoch):
    built, keys, _ = records_epoch
    other = RecordsTable(seed=built.table.seed + 1, num_pages=built.table.num_pages,
                         key_bytes=20, value_bytes=40)
    response = APIClient().post("/query/page/gpu", {"keys": ["00"] * 3}, format="json",
                                **{HEADER: other.fingerprint_hex})
    assert response.status_code == 409
    body = response.json()
    assert body["errors"][0]["field"] == "X-Morpho-Records-Fingerprint"
    assert body["errors"][0]["code"] == "records_fingerprint"
    assert built.table.fingerprint_hex in body["detail"] and other.fingerprint_hex in body["detail"]


def test_a_lookup_to_a_party_serving_pages_without_records_is_refused(db, serve_matrix, tmp_path):
    path = write_matrix_file(tmp_path / "pages.bin", 16, seed=1)
    write_epoch_metadata(path, epoch_id=3)
    serve_matrix(path)
    assert "records" not in APIClient().get("/epoch").json()
    response = APIClient().post("/query/page/gpu/batch", {"queries": []}, format="json",
                                **{HEADER: "0x" + "11" * 16})
    assert response.status_code == 409
    assert "epoch 3 holds no records table" in response.json()["detail"]


def test_set_overwrite_and_delete_through_the_api_are_seen_by_the_next_lookup(records_epoch,
                                                                           operator):
    built, keys, values = records_epoch
    table = built.table
    new_key, new_value = bytes(range(100, 120)), bytes(range(40))
    response = operator.post("/api/records/", {"op": "set", "key": "0x" + new_key.hex(),
                                               "value": new_value.hex(), "record_type": 9},
                             format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["epoch_id"] == 7 and body["key"] == "0x" + new_key.hex() and body["rows"]
    assert RowUpdate.objects.count() == len(body["rows"])
    found = lookup(table, new_key)
    assert (found.value, found.type) == (new_value, 9)
    present = keys[5].tobytes()
    response = operator.post("/api/records/", {"key": present.hex(), "value": "ab" * 40},
                             format="json")
    assert response.status_code == 201 and len(response.json()["rows"]) == 1
    assert lookup(table, present).value == b"\xab" * 40
    response = operator.post("/api/records/", {"op": "delete", "key": present.hex()}, format="json")
    assert response.status_code == 201, response.content
    assert lookup(table, present) is None
    assert lookup(table, keys[6].tobytes()).value == values[6].tobytes()
    listed = operator.get("/api/records/").json()
    assert [change["op"] for change in listed["results"]] == ["delete", "set", "set"]


@pytest.mark.parametrize("body, field, message", [
    ({"key": "00" * 19, "value": "00" * 40}, "key", "expected 20 bytes, got 19"),
    ({"key": "00" * 20, "value": "00" * 41}, "value", "expected 40 bytes, got 41"),
    ({"key": "00" * 20, "value": "00" * 40, "record_type": 0}, "record_type",
     "expected an integer in 1..255"),
    ({"op": "delete", "key": "00" * 20, "value": "00"}, "value", "expected nothing for a delete"),
    ({"op": "move", "key": "00" * 20}, "op", 'expected one of set, delete, got "move"'),
])
def test_a_bad_change_is_a_400_naming_the_field(records_epoch, operator, body, field, message):
    response = operator.post("/api/records/", body, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["errors"][0]["field"] == field
    assert message in response.json()["detail"]
    assert not RecordChange.objects.exists() and not RowUpdate.objects.exists()


def test_a_set_with_no_room_is_a_409_saying_to_rebuild_and_writes_nothing(db, serve_matrix,
                                                                          tmp_path, operator):
    path, built, _, _ = write_records_epoch(tmp_path, 3 * ROWS_PER_PAGE, num_pages=3)
    serve_matrix(path)
    get_engine()
    response = operator.post("/api/records/", {"key": "77" * 20, "value": "00" * 40},
                             format="json")
    assert response.status_code == 409
    assert "rebuild the records epoch" in response.json()["detail"]
    assert not RecordChange.objects.exists() and not RowUpdate.objects.exists()
    assert APIClient().get("/epoch").json()["state"]["updates"] == 0


def test_records_changes_need_a_signed_in_operator(records_epoch):
    response = APIClient().post("/api/records/", {"key": "00" * 20, "value": "00" * 40},
                                format="json")
    assert response.status_code == 401

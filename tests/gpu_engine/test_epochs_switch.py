"""Engine-level epoch switches: beside and stop-the-world, and a device too small for both."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gpu_engine.backends import BackendUnavailable
from gpu_engine.backends.cpu import NumpyBackend, reference_answers
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.engine import Engine, SwitchMode
from gpu_engine.matrix import PageMatrix, ServedEpoch, random_matrix


class SmallDevice(NumpyBackend):
    """A CPU backend with a device-memory budget, refusing loads past it like the CUDA backend."""

    def __init__(self, capacity: int) -> None:
        super().__init__(workers=1)
        self.capacity = capacity
        self.resident = []

    def load(self, matrix, progress=None):
        used = sum(r.nbytes for r in self.resident)
        if used + matrix.nbytes > self.capacity:
            raise BackendUnavailable(
                f"matrix of {matrix.nbytes} bytes does not fit: {self.capacity - used} of "
                f"{self.capacity} bytes free")
        # Like a GPU, the device holds its own copy: rows written to it never reach the host.
        copy = PageMatrix(matrix.block(0, matrix.num_pages).copy(), domain_bits=matrix.domain_bits)
        resident = super().load(copy, progress)
        release = resident.release

        def release_and_forget():
            release()
            self.resident.remove(resident)

        resident.release = release_and_forget
        self.resident.append(resident)
        return resident


def _query(engine, target, rng):
    keys = [gen_keys(target, engine.epoch.matrix.domain_bits, rng=rng)[0] for _ in range(3)]
    return keys, engine.answer([keys], timeout=30)


@pytest.mark.parametrize("mode", list(SwitchMode))
def test_switch_serves_the_new_epoch_and_names_it(mode):
    rng = np.random.default_rng(1)
    old = ServedEpoch(1, random_matrix(32, seed=1))
    new = ServedEpoch(2, random_matrix(32, seed=2))
    engine = Engine(NumpyBackend(workers=1), old).start()
    try:
        keys, before = _query(engine, 5, rng)
        assert before.epoch_id == 1
        engine.switch_epoch(new, mode).result(10)
        keys, after = _query(engine, 5, rng)
        assert after.epoch_id == 2
        expected = reference_answers(random_matrix(32, seed=2), KeyBatch.from_keys(keys))
        assert [bytes(a) for a in after.pages[0]] == [e.tobytes() for e in expected]
    finally:
        engine.stop()


def test_too_small_for_both_refuses_beside_and_stop_the_world_succeeds():
    old = ServedEpoch(1, random_matrix(16, seed=1))
    new = ServedEpoch(2, random_matrix(16, seed=2))
    backend = SmallDevice(capacity=old.matrix.nbytes + 1024)
    engine = Engine(backend, old).start()
    try:
        with pytest.raises(BackendUnavailable, match="does not fit"):
            engine.switch_epoch(new).result(10)
        assert engine.epoch.epoch_id == 1
        engine.switch_epoch(new, SwitchMode.STOP_THE_WORLD).result(10)
        assert engine.epoch.epoch_id == 2
        assert len(backend.resident) == 1
    finally:
        engine.stop()


def test_stop_the_world_that_cannot_load_goes_back_to_the_current_epoch():
    old = ServedEpoch(1, random_matrix(16, seed=1))
    too_big = ServedEpoch(2, random_matrix(64, seed=2))
    engine = Engine(SmallDevice(capacity=old.matrix.nbytes), old).start()
    try:
        with pytest.raises(BackendUnavailable, match="does not fit"):
            engine.switch_epoch(too_big, SwitchMode.STOP_THE_WORLD).result(10)
        rng = np.random.default_rng(3)
        keys, answer = _query(engine, 3, rng)
        assert answer.epoch_id == 1
        expected = reference_answers(random_matrix(16, seed=1), KeyBatch.from_keys(keys))
        assert [bytes(a) for a in answer.pages[0]] == [e.tobytes() for e in expected]
    finally:
        engine.stop()


# --- The same through the operations API and the admin ----------------------------------------


@pytest.fixture
def small_device_party(db, serve_matrix, tmp_path, monkeypatch):
    """Epoch 1 served from a device with room for one 16-page matrix; epoch 2 recorded, not active."""
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from epochs.models import Epoch
    from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
    from engine.holder import get_engine

    paths = {}
    for epoch_id in (1, 2):
        paths[epoch_id] = write_matrix_file(tmp_path / f"e{epoch_id}.bin", 16, seed=epoch_id)
        write_epoch_metadata(paths[epoch_id], epoch_id=epoch_id)
    device = SmallDevice(capacity=16 * 4096 + 1024)
    monkeypatch.setattr("gpu_engine.backends.factory.create_backend", lambda name="auto", v2_scan="auto", layout="pages": device)
    serve_matrix(paths[1])
    get_engine()
    record = Epoch(epoch_id=2, matrix_path=str(paths[2]))
    record.full_clean()
    record.save()
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("root", password="pw-root"))
    return client, record, device


def test_api_refuses_a_switch_that_does_not_fit_and_offers_stop_the_world(small_device_party):
    from engine.holder import get_engine

    client, record, device = small_device_party
    refused = client.post(f"/api/epochs/{record.pk}/activate/", {}, format="json")
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "does not fit" in detail and "65536 bytes" in detail
    assert "activate it with switch mode 'stop the world'" in detail
    record.refresh_from_db()
    assert record.state == "loaded" and "does not fit" in record.message
    assert get_engine().epoch.epoch_id == 1

    switched = client.post(f"/api/epochs/{record.pk}/activate/", {"switch_mode": "stop_the_world"},
                           format="json")
    assert switched.status_code == 200, switched.content
    assert switched.json()["state"] == "active" and switched.json()["switch_mode"] == "stop_the_world"
    assert get_engine().epoch.epoch_id == 2 and len(device.resident) == 1


def test_admin_action_reports_the_refusal_in_words(small_device_party, client):
    client.login(username="root", password="pw-root")
    _, record, _ = small_device_party
    response = client.post("/admin/epochs/epoch/", {"action": "activate_beside", "_selected_action": [record.pk]},
                           follow=True)
    text = response.content.decode()
    assert "Epoch 2 was not activated" in text and "does not fit" in text
    response = client.post("/admin/epochs/epoch/", {"action": "activate_stop_the_world",
                                                    "_selected_action": [record.pk]}, follow=True)
    assert "Epoch 2 is active" in response.content.decode()


def test_failed_stop_the_world_keeps_serving_the_current_epoch_with_its_updates(small_device_party, tmp_path):
    from epochs import sync
    from epochs.models import Epoch
    from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file
    from engine.holder import get_engine

    client, record, _ = small_device_party
    data = bytes([7]) * 256
    sync.push_rows([(5, data)])
    huge_path = write_matrix_file(tmp_path / "e3.bin", 64, seed=3)
    write_epoch_metadata(huge_path, epoch_id=3)
    huge = Epoch(epoch_id=3, matrix_path=str(huge_path))
    huge.full_clean()
    huge.save()
    refused = client.post(f"/api/epochs/{huge.pk}/activate/", {"switch_mode": "stop_the_world"}, format="json")
    assert refused.status_code == 409 and "does not fit" in refused.json()["detail"]
    engine = get_engine()
    assert engine.epoch.epoch_id == 1
    rng = np.random.default_rng(5)
    keys, answer = _query(engine, 0, rng)
    expected = load_matrix(record.matrix_path.replace("e2", "e1"))
    expected.write_row(5, data)
    assert [bytes(a) for a in answer.pages[0]] == [
        e.tobytes() for e in reference_answers(expected, KeyBatch.from_keys(keys))]


# --- The database while a switch loads: written by others, unchanged by a failure -------------

ROW5, ROW9 = bytes([5]) * 256, bytes([9]) * 256


@pytest.fixture
def committed_party(django_db_serialized_rollback, transactional_db, serve_matrix, tmp_path):
    """Epoch 1 served with row 5 updated, epochs 2 and 3 recorded. Every write commits, so other
    connections (other threads here, other processes in a party) see and contend for it; the
    rows the migrations made (the default policies) are restored after the flush, for later tests."""
    from epochs import sync
    from epochs.models import Epoch
    from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
    from engine.holder import get_engine
    from engine.watcher import default_watcher

    paths, records = {}, {}
    for epoch_id in (1, 2, 3):
        paths[epoch_id] = write_matrix_file(tmp_path / f"e{epoch_id}.bin", 16, seed=epoch_id)
        write_epoch_metadata(paths[epoch_id], epoch_id=epoch_id)
    serve_matrix(paths[1])
    engine = get_engine()
    # The test's own threads are the other connections; the watcher's polls would be one more
    # (conftest keeps its thread off over the tests' SQLite).
    default_watcher().stop()
    sync.push_rows([(5, ROW5)])
    for epoch_id in (2, 3):
        records[epoch_id] = Epoch(epoch_id=epoch_id, matrix_path=str(paths[epoch_id]))
        records[epoch_id].full_clean()
        records[epoch_id].save()
    yield engine, records, paths
    default_watcher().start()


def _database_state():
    """Everything a switch changes, bar the message that reports a failed one."""
    from epochs.models import Epoch
    from epochs.models import RowUpdate

    return (sorted(Epoch.objects.values_list("epoch_id", "state", "activated", "switch_mode",
                                                    "pending_updates")),
            sorted(RowUpdate.objects.values_list("pk", "epoch_id", "row", "state")))


def _serves(engine, path, rows):
    """The engine's answers to keys for page 0 equal those of the file at `path` with `rows`."""
    from gpu_engine.matrix import load_matrix

    keys, answer = _query(engine, 0, np.random.default_rng(11))
    expected = load_matrix(path)
    for row, data in rows.items():
        expected.write_row(row, data)
    return [bytes(a) for a in answer.pages[0]] == [
        e.tobytes() for e in reference_answers(expected, KeyBatch.from_keys(keys))]


class HeldUpload:
    """Holds the first matrix upload of `engine`'s backend until released (or fails it)."""

    def __init__(self, engine, monkeypatch, error: Exception | None = None) -> None:
        self.started, self.released = threading.Event(), threading.Event()
        self.error = error
        self.calls = 0
        upload = engine.backend.load

        def held(matrix, progress=None):
            self.calls += 1
            if self.calls == 1:
                self.started.set()
                if self.error is not None:
                    raise self.error
                self.released.wait(30)
            return upload(matrix, progress)

        monkeypatch.setattr(engine.backend, "load", held)


def _switch_in_thread(record):
    """sync.activate(record) on its own thread and database connection; (thread, outcome)."""
    from django.db import connection

    from epochs import sync

    outcome = {}

    def switch():
        try:
            outcome["record"] = sync.activate(record)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=switch)
    thread.start()
    return thread, outcome


def test_the_database_stays_writable_while_the_new_epoch_loads(committed_party, monkeypatch):
    from epochs.models import Epoch
    from epochs.models import PendingUpdates, RowUpdate

    engine, records, paths = committed_party
    upload = HeldUpload(engine, monkeypatch)
    backstop = threading.Timer(10, upload.released.set)  # the old code would wait on the writes
    backstop.start()
    switcher, outcome = _switch_in_thread(records[2])
    try:
        assert upload.started.wait(30)
        # This thread's connection writes what other processes write meanwhile: a row update
        # stored by a web process, and an operator's edit of how to switch back to epoch 1 (a row
        # the switch changes). Under a write transaction held for the upload, SQLite refuses or
        # delays both and PostgreSQL delays the second.
        RowUpdate.objects.create(epoch_id=1, first_epoch_id=1, row=9, data=ROW9.hex())
        Epoch.objects.filter(epoch_id=1).update(pending_updates=PendingUpdates.DISCARD)
        assert not upload.released.is_set(), "the writes waited for the upload to end"
        assert switcher.is_alive() and engine.epoch.epoch_id == 1
    finally:
        upload.released.set()
        backstop.cancel()
        switcher.join(30)
    assert "error" not in outcome, outcome
    states = dict(Epoch.objects.values_list("epoch_id", "state"))
    assert states == {1: "retired", 2: "active", 3: "loaded"}
    assert Epoch.objects.get(epoch_id=1).pending_updates == PendingUpdates.DISCARD
    # The update stored during the load was absorbed by epoch 2 and is in its answers.
    assert sorted(RowUpdate.objects.values_list("row", "epoch_id", "state")) == [
        (5, 2, "pending"), (9, 2, "pending")]
    assert engine.epoch.epoch_id == 2 and _serves(engine, paths[2], {5: ROW5, 9: ROW9})


@pytest.mark.parametrize("mode", list(SwitchMode))
def test_a_failed_load_changes_nothing(committed_party, monkeypatch, mode):
    from epochs import sync

    engine, records, paths = committed_party
    before = _database_state()
    upload = HeldUpload(engine, monkeypatch, error=OSError("device lost during the upload"))
    with pytest.raises(sync.EpochSwitchError, match="OSError: device lost during the upload"):
        sync.activate(records[2], mode)
    assert upload.calls == (2 if mode is SwitchMode.STOP_THE_WORLD else 1)  # stop the world reloads
    assert _database_state() == before
    records[2].refresh_from_db()
    assert records[2].state == "loaded" and "device lost" in records[2].message
    assert engine.epoch.epoch_id == 1 and _serves(engine, paths[1], {5: ROW5})


def test_a_switch_committed_elsewhere_during_the_load_wins(committed_party, monkeypatch):
    from epochs import sync
    from epochs.models import Epoch
    from epochs.models import RowUpdate

    engine, records, paths = committed_party
    upload = HeldUpload(engine, monkeypatch)
    switcher, outcome = _switch_in_thread(records[2])
    try:
        assert upload.started.wait(30)
        # Another engine server of the party, done loading epoch 3, commits its switch first.
        sync._commit_switch(records[3], 1, sync._active_marks())
    finally:
        upload.released.set()
        switcher.join(30)
    assert "another switch (to epoch 3) committed while epoch 2 loaded" in str(outcome.get("error"))
    states = dict(Epoch.objects.values_list("epoch_id", "state"))
    assert states == {1: "retired", 2: "loaded", 3: "active"}
    assert list(RowUpdate.objects.values_list("row", "epoch_id", "state")) == [(5, 3, "pending")]
    # This process's engine follows the database rather than the epoch it had loaded.
    assert engine.epoch.epoch_id == 3 and _serves(engine, paths[3], {5: ROW5})

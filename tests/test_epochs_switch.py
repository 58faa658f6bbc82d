"""Engine-level epoch switches: beside and stop-the-world, and a device too small for both."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.backends import BackendUnavailable
from gpu_engine.backends.cpu import NumpyBackend, reference_answers
from gpu_engine.dpf import KeyBatch, gen_keys
from gpu_engine.engine import Engine
from gpu_engine.matrix import Epoch, PageMatrix, random_matrix


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


@pytest.mark.parametrize("stop_the_world", [False, True])
def test_switch_serves_the_new_epoch_and_names_it(stop_the_world):
    rng = np.random.default_rng(1)
    old = Epoch(1, random_matrix(32, seed=1))
    new = Epoch(2, random_matrix(32, seed=2))
    engine = Engine(NumpyBackend(workers=1), old).start()
    try:
        keys, before = _query(engine, 5, rng)
        assert before.epoch_id == 1
        engine.switch_epoch(new, stop_the_world=stop_the_world).result(10)
        keys, after = _query(engine, 5, rng)
        assert after.epoch_id == 2
        expected = reference_answers(random_matrix(32, seed=2), KeyBatch.from_keys(keys))
        assert [bytes(a) for a in after.pages[0]] == [e.tobytes() for e in expected]
    finally:
        engine.stop()


def test_too_small_for_both_refuses_beside_and_stop_the_world_succeeds():
    old = Epoch(1, random_matrix(16, seed=1))
    new = Epoch(2, random_matrix(16, seed=2))
    backend = SmallDevice(capacity=old.matrix.nbytes + 1024)
    engine = Engine(backend, old).start()
    try:
        with pytest.raises(BackendUnavailable, match="does not fit"):
            engine.switch_epoch(new).result(10)
        assert engine.epoch.epoch_id == 1
        engine.switch_epoch(new, stop_the_world=True).result(10)
        assert engine.epoch.epoch_id == 2
        assert len(backend.resident) == 1
    finally:
        engine.stop()


def test_stop_the_world_that_cannot_load_goes_back_to_the_current_epoch():
    old = Epoch(1, random_matrix(16, seed=1))
    too_big = Epoch(2, random_matrix(64, seed=2))
    engine = Engine(SmallDevice(capacity=old.matrix.nbytes), old).start()
    try:
        with pytest.raises(BackendUnavailable, match="does not fit"):
            engine.switch_epoch(too_big, stop_the_world=True).result(10)
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

    from epochs.models import Epoch as EpochRecord
    from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
    from morphoweb.engine_runtime import get_engine

    paths = {}
    for epoch_id in (1, 2):
        paths[epoch_id] = write_matrix_file(tmp_path / f"e{epoch_id}.bin", 16, seed=epoch_id)
        write_epoch_metadata(paths[epoch_id], epoch_id=epoch_id)
    device = SmallDevice(capacity=16 * 4096 + 1024)
    monkeypatch.setattr("gpu_engine.backends.create_backend", lambda name="auto": device)
    serve_matrix(paths[1])
    get_engine()
    record = EpochRecord(epoch_id=2, matrix_path=str(paths[2]))
    record.full_clean()
    record.save()
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("root", password="pw-root"))
    return client, record, device


def test_api_refuses_a_switch_that_does_not_fit_and_offers_stop_the_world(small_device_party):
    from morphoweb.engine_runtime import get_engine

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
    from epochs import runtime
    from epochs.models import Epoch as EpochRecord
    from gpu_engine.matrix import load_matrix, write_matrix_file
    from morphoweb.engine_runtime import get_engine

    client, record, _ = small_device_party
    data = bytes([7]) * 256
    runtime.push_rows([(5, data)])
    huge = EpochRecord(epoch_id=3, matrix_path=str(write_matrix_file(tmp_path / "e3.bin", 64, seed=3)))
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

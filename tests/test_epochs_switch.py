"""Engine-level epoch switches: beside and stop-the-world, and a device too small for both."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.backends import BackendUnavailable
from gpu_engine.backends.cpu import NumpyBackend, reference_answers
from gpu_engine.dpf import KeyBatch, gen_keys
from gpu_engine.engine import Engine
from gpu_engine.matrix import Epoch, random_matrix


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
        resident = super().load(matrix, progress)
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

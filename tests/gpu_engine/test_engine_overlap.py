"""A full batch starts on the device while the one before it runs; anything else waits for it.

A backend whose batches run apart from the host (CUDA) returns from `start` at once; the engine
then hands out one batch's answers while the next one runs. These tests drive the engine with a
backend whose batches finish only when the test says so, and check what a client would see: the
right answers in order, a full batch started behind a running one, a smaller batch held back until
the device is free (so late queries can still join it), and row writes never landing while a
batch is on the device.
"""
import threading

import numpy as np
import pytest

from gpu_engine.backends.base import PendingAnswer
from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, random_keys
from gpu_engine.engine import Engine
from gpu_engine.matrix import ServedEpoch, random_matrix
from morpho_pir.protocol import KEYS_PER_QUERY
from gpu_engine.scheduler import LanePolicy
from tests.protocol_vectors import protocol_answers

MAX_BATCH = 4  # queries per launch in these tests


class HeldBatch(PendingAnswer):
    """Answers computed by the NumPy backend, handed out once the test releases the batch."""

    def __init__(self, log, answers) -> None:
        super().__init__(answers)
        self.log, self.release = log, threading.Event()

    def result(self):
        assert self.release.wait(20), "the test never released this batch"
        self.log.append(("collected", len(self._answers) // KEYS_PER_QUERY))
        return self._answers


class HeldBackend(NumpyBackend):
    """NumPy answers; every batch stays "on the device" until the test releases it."""

    def __init__(self) -> None:
        super().__init__(workers=1)
        self.log: list = []
        self.started: list = []
        self.changed = threading.Condition()
        self.entered = threading.Event()  # the scheduler is inside start()
        self.gate = threading.Event()  # start() returns only once this is set
        self.gate.set()

    def load(self, matrix, progress=None):
        resident = super().load(matrix, progress)
        backend, answer, write = self, resident.answer, resident.write_rows

        def start(keys, dispatch=None):
            backend.entered.set()
            assert backend.gate.wait(20), "the test never opened the gate"
            batch = HeldBatch(backend.log, answer(keys))
            with backend.changed:
                backend.log.append(("started", len(keys) // KEYS_PER_QUERY))
                backend.started.append(batch)
                backend.changed.notify_all()
            return batch

        def write_rows(rows):
            backend.log.append(("rows written", len(rows)))
            write(rows)

        resident.start, resident.write_rows = start, write_rows
        resident.answer = lambda keys, dispatch=None: start(keys, dispatch).result()  # as CUDA's
        return resident

    def wait_started(self, count: int) -> HeldBatch:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.started) >= count, 20), self.log
            return self.started[count - 1]


@pytest.fixture
def held():
    backend = HeldBackend()
    matrix = random_matrix(300, seed=5)
    policy = LanePolicy(max_batch=MAX_BATCH)
    engine = Engine(backend, ServedEpoch(epoch_id=1, matrix=matrix), lambda lane: policy).start()
    yield engine, backend, random_matrix(300, seed=5)
    for batch in backend.started:
        batch.release.set()
    engine.stop()


def _submit(engine, queries: int, rng):
    keys = random_keys(queries * KEYS_PER_QUERY, engine.epoch.matrix.domain_bits, rng)
    return keys, engine.submit_keys(keys, (KEYS_PER_QUERY,) * queries)


def _answers(future) -> list:
    return [page.tobytes() for page in future.result(20).answers]


def _full_batch_held_in_start(engine, backend, rng):
    """Submit a full batch and keep the scheduler inside its start() (the gate closed): what is
    submitted meanwhile is queued when the batch has started. Returns the batch's (keys, future)."""
    backend.gate.clear()
    backend.entered.clear()
    submitted = _submit(engine, MAX_BATCH, rng)
    assert backend.entered.wait(20)
    return submitted


def test_a_full_batch_starts_behind_the_running_one_and_answers_stay_in_order(held):
    engine, backend, matrix = held
    rng = np.random.default_rng(1)
    first_keys, first = _full_batch_held_in_start(engine, backend, rng)
    second_keys, second = _submit(engine, MAX_BATCH, rng)  # queued while the first starts
    backend.gate.set()
    behind = backend.wait_started(2)  # started while the first is still on the device
    assert backend.log == [("started", MAX_BATCH), ("started", MAX_BATCH)]
    backend.started[0].release.set()
    assert _answers(first) == [a.tobytes() for a in protocol_answers(matrix, first_keys)]
    assert not second.done()
    behind.release.set()
    assert _answers(second) == [a.tobytes() for a in protocol_answers(matrix, second_keys)]


def test_a_batch_short_of_full_waits_for_the_device_and_takes_what_arrived_meanwhile(held):
    engine, backend, matrix = held
    rng = np.random.default_rng(2)
    _, first = _full_batch_held_in_start(engine, backend, rng)
    late = [_submit(engine, 1, rng) for _ in range(MAX_BATCH - 1)]  # queued as the first starts
    backend.gate.set()
    running = backend.wait_started(1)
    late.append(_submit(engine, 1, rng))  # arrives while the first batch is on the device
    with backend.changed:
        assert not backend.changed.wait_for(lambda: len(backend.started) > 1, 0.3), backend.log
    running.release.set()
    first.result(20)
    backend.wait_started(2).release.set()
    for keys, future in late:
        assert _answers(future) == [a.tobytes() for a in protocol_answers(matrix, keys)]
    assert backend.log == [("started", MAX_BATCH), ("collected", MAX_BATCH),
                           ("started", MAX_BATCH), ("collected", MAX_BATCH)]


def test_rows_are_written_only_with_no_batch_on_the_device(held):
    engine, backend, matrix = held
    rng = np.random.default_rng(3)
    _, first = _submit(engine, MAX_BATCH, rng)
    running = backend.wait_started(1)
    row = bytes(range(256))
    written = engine.write_rows({7: row})
    assert not written.done()
    running.release.set()
    written.result(20)
    assert backend.log.index(("rows written", 1)) > backend.log.index(("collected", MAX_BATCH))
    keys, after = _submit(engine, 1, rng)
    backend.wait_started(2).release.set()
    matrix.write_row(7, row)
    assert _answers(after) == [a.tobytes() for a in protocol_answers(matrix, keys)]


def test_warm_up_starts_two_full_batches_at_once(held):
    engine, backend, _ = held
    backend.warm_all_shapes = True  # as CUDA: every batch size, and the second buffer set
    warming = engine.warm_up(MAX_BATCH)
    while not warming.done():
        with backend.changed:
            backend.changed.wait(0.05)
            for batch in backend.started:
                batch.release.set()
    warming.result(20)
    sizes = [size for event, size in backend.log if event == "started"]
    # each size: each format twice (the second timed, for its own cost model); full batches of
    # each format twice at once
    assert sizes == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3] + [4] * 8
    assert backend.log[-8:] == [("started", 4), ("started", 4), ("collected", 4), ("collected", 4)] * 2
    assert {fmt: fit.samples for fmt, fit in engine.cost.by_format().items()} == {KEY_FORMAT_V1: 4, KEY_FORMAT_V2: 4}


def test_a_replicated_epoch_keeps_two_full_batches_on_each_device():
    """Over two devices, four full batches run at once (two on each), the fifth waits for the first
    to be answered, and every answer is right."""
    from gpu_engine.placement import DeviceGroup

    devices = [HeldBackend(), HeldBackend()]
    matrix = random_matrix(300, seed=5)
    policy = LanePolicy(max_batch=MAX_BATCH)
    engine = Engine(DeviceGroup(devices, ["cpu:0", "cpu:1"]),
                    ServedEpoch(epoch_id=1, matrix=matrix, placement="replicate"),
                    lambda lane: policy).start()
    try:
        rng = np.random.default_rng(4)
        submitted = [_submit(engine, MAX_BATCH, rng) for _ in range(5)]
        for backend in devices:
            backend.wait_started(2)
        assert [len(b.started) for b in devices] == [2, 2]  # the fifth is not started yet
        devices[0].started[0].release.set()  # the first answered: the fifth goes on that device
        devices[0].wait_started(3)
        for backend in devices:
            for batch in backend.started:
                batch.release.set()
        for keys, future in submitted:
            assert _answers(future) == [a.tobytes() for a in protocol_answers(matrix, keys)]
    finally:
        for backend in devices:
            for batch in backend.started:
                batch.release.set()
        engine.stop()

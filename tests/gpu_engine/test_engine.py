"""The Engine: answers, coalescing, row writes, epoch switches, backpressure, deadlines, live policies."""
import threading

import numpy as np
import pytest

from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.backends.base import DispatchShape
from gpu_engine.engine import Engine, EngineOverloaded, EngineUnavailable
from gpu_engine.matrix import ServedEpoch, random_matrix
from gpu_engine.scheduler import LanePolicy, PolicyError
from tests.protocol_vectors import protocol_answers


def _query(target, d, rng, key_format=1):
    """Three key pairs (target plus two decoys), as a client would make them."""
    pairs = [gen_keys(int(t), d, rng, key_format=key_format)
             for t in (target, rng.integers(1 << d), rng.integers(1 << d))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _answered(answer):
    """Every answer of a BatchAnswer as bytes, queries in order, keys in order."""
    return [bytes(page) for query in answer.pages for page in query]


def _expected(matrix, queries, rows=None):
    """The answers `queries` (lists of keys) must get from `matrix` with `rows` written over it,
    by the protocol's formula on a matrix built here, not by the engine or its backend."""
    for row, data in (rows or {}).items():
        matrix.write_row(row, data)
    keys = [key for query in queries for key in query]
    return [answer.tobytes() for answer in protocol_answers(matrix, KeyBatch.from_keys(keys))]


@pytest.fixture
def engine():
    epoch = ServedEpoch(epoch_id=3, matrix=random_matrix(300, seed=1))
    eng = Engine(NumpyBackend(workers=1), epoch).start()
    yield eng
    eng.stop()


def test_request_answers_recover_pages(engine):
    rng = np.random.default_rng(0)
    d = engine.epoch.matrix.domain_bits
    queries = [_query(t, d, rng) for t in (0, 17, 299)]
    a = engine.answer([q[0] for q in queries], timeout=30)
    b = engine.answer([q[1] for q in queries], timeout=30)
    assert a.epoch_id == b.epoch_id == 3
    for i, target in enumerate((0, 17, 299)):
        recovered = bytes(x ^ y for x, y in zip(a.pages[i][0], b.pages[i][0]))
        assert recovered == engine.epoch.matrix.page(target)
    assert _answered(a) == _expected(random_matrix(300, seed=1), [q[0] for q in queries])
    assert _answered(b) == _expected(random_matrix(300, seed=1), [q[1] for q in queries])


def test_concurrent_requests_are_coalesced_into_fewer_launches(engine):
    rng = np.random.default_rng(1)
    d = engine.epoch.matrix.domain_bits
    requests = [[_query(t, d, rng)[0]] for t in range(24)]
    gate = threading.Event()
    engine.write_rows({0: b"\x00" * 256})  # a control op the loop runs first
    results = [None] * len(requests)

    def client(i):
        gate.wait()
        results[i] = engine.answer(requests[i], timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert engine.stats.queries_answered == 24
    assert engine.stats.launches < 24
    assert all(r is not None and len(r.pages) == 1 for r in results)
    # Coalesced launches still answer each request from its own keys (row 0 written first).
    expected = _expected(random_matrix(300, seed=1), [r[0] for r in requests], {0: b"\x00" * 256})
    assert [page for r in results for page in _answered(r)] == expected


def test_requests_of_both_key_formats_coalesce_and_each_gets_its_own_answers(engine):
    # v1 and v2 requests (PROTOCOL.md section 3.1) share the queue; a launch takes one format
    rng = np.random.default_rng(4)
    d = engine.epoch.matrix.domain_bits
    targets = list(range(0, 300, 13))
    pairs = [_query(t, d, rng, key_format=1 + i % 2) for i, t in enumerate(targets)]
    gate = threading.Event()
    results = {}

    def client(i, side):
        gate.wait()
        results[i, side] = engine.answer([pairs[i][side]], timeout=60)

    threads = [threading.Thread(target=client, args=(i, side))
               for i in range(len(targets)) for side in (0, 1)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert engine.stats.queries_answered == 2 * len(targets)
    for i, target in enumerate(targets):
        a, b = results[i, 0], results[i, 1]
        assert bytes(x ^ y for x, y in zip(a.pages[0][0], b.pages[0][0])) == engine.epoch.matrix.page(target)
        assert _answered(a) == _expected(random_matrix(300, seed=1), [pairs[i][0]])


def test_row_write_is_in_every_later_answer(engine):
    rng = np.random.default_rng(2)
    d = engine.epoch.matrix.domain_bits
    engine.write_rows({5 * 16 + 2: b"\xee" * 256}).result(10)
    q0, q1 = _query(5, d, rng)
    a0, a1 = engine.answer([q0]), engine.answer([q1])
    page = bytes(x ^ y for x, y in zip(a0.pages[0][0], a1.pages[0][0]))
    assert page[2 * 256 : 3 * 256] == b"\xee" * 256
    written = random_matrix(300, seed=1)
    written.write_row(5 * 16 + 2, b"\xee" * 256)
    assert page == written.page(5)  # the other rows of the page are the epoch's own
    assert _answered(a0) + _answered(a1) == _expected(written, [q0, q1])


def test_bad_row_write_is_refused_before_queueing(engine):
    with pytest.raises(ValueError, match="expected 256"):
        engine.write_rows({1: b"short"})


def test_epoch_switch_is_atomic_per_request(engine):
    rng = np.random.default_rng(3)
    new = ServedEpoch(epoch_id=4, matrix=random_matrix(300, seed=2))
    d = new.matrix.domain_bits
    engine.switch_epoch(new).result(30)
    q0, q1 = _query(9, d, rng)
    a, b = engine.answer([q0]), engine.answer([q1])
    assert a.epoch_id == b.epoch_id == 4
    assert bytes(x ^ y for x, y in zip(a.pages[0][0], b.pages[0][0])) == new.matrix.page(9)
    assert _answered(a) + _answered(b) == _expected(random_matrix(300, seed=2), [q0, q1])


def test_submit_validates_and_refuses_when_stopped():
    epoch = ServedEpoch(epoch_id=1, matrix=random_matrix(4, seed=0))
    eng = Engine(NumpyBackend(workers=1), epoch)
    key = gen_keys(1, 2)[0]
    with pytest.raises(EngineUnavailable, match="not running"):
        eng.submit([[key]])
    eng.start()
    with pytest.raises(ValueError, match="unknown lane 'fast'"):
        eng.submit([[key]], lane="fast")
    with pytest.raises(ValueError, match="domain_bits 5, the epoch has 2"):
        eng.submit([[gen_keys(1, 5)[0]]])
    eng.stop()


class GatedBackend(NumpyBackend):
    """The NumPy backend, but each launch waits for `gate` and records the dispatch it was given."""

    def __init__(self):
        super().__init__(workers=1)
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        self.dispatches = []

    def load(self, matrix, progress=None):
        resident = super().load(matrix, progress)
        answer = resident.answer

        def gated(keys, dispatch=DispatchShape()):
            self.dispatches.append((len(keys), dispatch))
            self.started.release()
            assert self.gate.wait(30)
            return answer(keys, dispatch)

        resident.answer = gated
        return resident


class Switch:
    """A PolicySource an operator changes while the engine runs."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, lane):
        return self.policy


def _gated_engine(policy):
    backend = GatedBackend()
    epoch = ServedEpoch(epoch_id=1, matrix=random_matrix(64, seed=4))
    eng = Engine(backend, epoch, Switch(policy)).start()
    return eng, backend


def test_full_queue_refuses_at_submit_with_retry_after():
    eng, backend = _gated_engine(LanePolicy(max_batch=2, max_queue=4))
    rng = np.random.default_rng(5)
    d = eng.epoch.matrix.domain_bits
    try:
        first = [_query(1, d, rng)[0]]
        running = eng.submit(first)  # launched, held at the gate
        assert backend.started.acquire(timeout=10)
        second = [_query(2, d, rng)[0] for _ in range(2)]
        queued = [eng.submit([query] * 2) for query in second]  # 4 queries queued
        with pytest.raises(EngineOverloaded) as caught:
            eng.submit([_query(3, d, rng)[0]])
        assert caught.value.reason == ("interactive queue is full: 4 queries queued, 1 more would "
                                       "pass the policy's max_queue of 4")
        assert caught.value.retry_after >= 1
        assert eng.snapshot()["lanes"]["interactive"]["refused"] == {"queue_full": 1}
        backend.gate.set()
        assert running.result(30).epoch_id == 1
        assert all(len(f.result(30).pages) == 2 for f in queued)
        assert _answered(running.result(30)) == _expected(random_matrix(64, seed=4), first)
        for future, query in zip(queued, second):
            assert _answered(future.result(30)) == _expected(random_matrix(64, seed=4), [query] * 2)
    finally:
        backend.gate.set()
        eng.stop()


def test_query_that_cannot_start_within_the_timeout_fails_overloaded():
    eng, backend = _gated_engine(LanePolicy(queue_timeout_ms=50, window_us=0))
    rng = np.random.default_rng(6)
    d = eng.epoch.matrix.domain_bits
    try:
        first_keys = _query(1, d, rng)[0]
        first = eng.submit([first_keys])
        assert backend.started.acquire(timeout=10)
        late = eng.submit([_query(2, d, rng)[0]])
        threading.Event().wait(0.15)  # the device stays busy past the second query's deadline
        backend.gate.set()
        assert len(first.result(30).pages) == 1
        assert _answered(first.result(30)) == _expected(random_matrix(64, seed=4), [first_keys])
        with pytest.raises(EngineOverloaded, match="not started within the policy's queue_timeout_ms of 50 ms"):
            late.result(30)
        assert eng.stats.refused == {"deadline": 1}
    finally:
        backend.gate.set()
        eng.stop()


def test_launch_uses_the_policy_dispatch_shape_and_a_changed_policy_applies_mid_stream():
    source = Switch(LanePolicy(mode="throughput", window_us=900_000, queue_timeout_ms=5000,
                                   micro_batch=6, streams=2))
    backend = GatedBackend()
    backend.gate.set()
    eng = Engine(backend, ServedEpoch(epoch_id=1, matrix=random_matrix(64, seed=4)), source).start()
    rng = np.random.default_rng(7)
    d = eng.epoch.matrix.domain_bits
    try:
        keys = _query(1, d, rng)[0]
        held = eng.submit([keys])  # throughput holds it for its 0.9 s window
        threading.Event().wait(0.1)
        assert not held.done()
        source.policy = LanePolicy(mode="latency", micro_batch=3, streams=4, cuda_graph=True)
        assert len(held.result(0.5).pages) == 1  # well before the old window would have closed
        assert _answered(held.result()) == _expected(random_matrix(64, seed=4), [keys])
        assert backend.dispatches == [(3, DispatchShape(3, 4, True))]
        snap = eng.snapshot()
        assert snap["dispatch_modes"] == {"latency": 1}
        assert snap["lanes"]["interactive"]["policy"] == "default"
        assert snap["lanes"]["interactive"]["mode"] == "latency"
    finally:
        eng.stop()


def test_a_launch_merges_requests_past_32_queries_up_to_the_policys_max_batch():
    # a request holds at most 32 queries; a launch (one pass over the matrix) up to 42
    eng, backend = _gated_engine(LanePolicy(mode="throughput", max_batch=42, max_queue=84, window_us=900_000))
    backend.gate.set()
    rng = np.random.default_rng(8)
    d = eng.epoch.matrix.domain_bits
    try:
        requests = [[_query(t % 64, d, rng)[0] for t in range(n)] for n in (32, 10, 5)]
        pending = [eng.submit(r) for r in requests]
        assert [len(p.result(5).pages) for p in pending[:2]] == [32, 10]  # full: no window wait
        assert backend.dispatches[0][0] == 42 * 3  # the first two requests, one launch of 126 keys
        assert len(pending[2].result(5).pages) == 5  # the third did not fit: the next launch
        expected = _expected(random_matrix(64, seed=4), [q for r in requests for q in r])
        assert [page for p in pending for page in _answered(p.result())] == expected
    finally:
        eng.stop()


def test_held_seconds_count_the_device_idle_while_a_policy_holds_for_a_fuller_batch(engine):
    rng = np.random.default_rng(10)
    d = engine.epoch.matrix.domain_bits
    engine.answer([_query(1, d, rng)[0]], timeout=30)
    lane = engine.snapshot()["lanes"]["interactive"]
    assert lane["held_seconds"] < 0.05 and lane["launches_held"] == 0  # latency: launched at once
    engine.set_policy_source(lambda lane: LanePolicy(mode="throughput", window_us=300_000))
    engine.answer([_query(2, d, rng)[0]], timeout=30)  # alone: waits out the whole window
    lane = engine.snapshot()["lanes"]["interactive"]
    assert 0.29 <= lane["held_seconds"] < 1.0 and (lane["launches"], lane["launches_held"]) == (2, 1)


def test_a_failing_policy_source_keeps_the_last_good_policy(engine):
    def broken(lane):
        raise RuntimeError("database away")

    engine.set_policy_source(broken)
    rng = np.random.default_rng(8)
    keys = _query(1, engine.epoch.matrix.domain_bits, rng)[0]
    answer = engine.answer([keys], timeout=30)
    assert len(answer.pages) == 1
    assert _answered(answer) == _expected(random_matrix(300, seed=1), [keys])


def test_snapshot_reports_what_metrics_and_admin_show(engine):
    rng = np.random.default_rng(9)
    d = engine.epoch.matrix.domain_bits
    for size in (1, 3, 2):
        engine.answer([_query(t, d, rng)[0] for t in range(size)], timeout=30)
    engine.answer([_query(4, d, rng)[0]], lane="bulk", timeout=30)
    snap = engine.snapshot()
    lane = snap["lanes"]["interactive"]
    assert (lane["queries"], lane["requests"], lane["launches"]) == (6, 3, 3)
    assert snap["lanes"]["bulk"]["queries"] == 1
    assert snap["launches"] == 4 and snap["queries_answered"] == 7
    assert snap["batch_size"]["count"] == 4 and snap["batch_size"]["sum"] == 7
    assert lane["latency"]["count"] == 6 and lane["compute"]["count"] == 3
    assert lane["queue_wait"]["buckets"][-1] == (float("inf"), 6)
    assert 0 < lane["p50_last_minute_s"] <= lane["p95_last_minute_s"] < 30
    assert lane["mean_batch_last_minute"] == pytest.approx(2.0)
    assert lane["arrival_rate"] > 0 and lane["queued"] == 0
    assert snap["cost"]["samples"] == 4 and snap["cost"]["intercept_s"] + snap["cost"]["per_query_s"] > 0
    assert snap["cost_by_format"] == {"v1": snap["cost"]}  # every launch so far was of v1 keys
    assert snap["dispatch_modes"] == {"latency": 4} and snap["launch_reasons"] == {"now": 4}


def test_launches_of_each_key_format_feed_their_own_cost_model(engine):
    rng = np.random.default_rng(6)
    d = engine.epoch.matrix.domain_bits
    for size in (1, 2):
        engine.answer([_query(t, d, rng, key_format=2)[0] for t in range(size)], timeout=30)
    assert set(engine.snapshot()["cost_by_format"]) == {"v2"}
    engine.answer([_query(5, d, rng)[0]], timeout=30)
    by_format = engine.snapshot()["cost_by_format"]
    assert (by_format["v1"]["samples"], by_format["v2"]["samples"]) == (1, 2)


def test_policy_bounds():
    with pytest.raises(PolicyError, match="max_batch must be in 1..74 queries, got 0"):
        LanePolicy(max_batch=0)


def test_launches_hold_no_more_than_the_backend_serves_in_one_pass():
    # a policy asks for 74 queries a launch (the wgmma scan's pass) of a backend that serves 58 in
    # one (mma.sync over the pages layout): the engine launches 58 at most, and says so
    backend = GatedBackend()
    backend.pass_queries = 58
    epoch = ServedEpoch(epoch_id=1, matrix=random_matrix(64, seed=4))
    policy = LanePolicy(name="wide", mode="adaptive", max_batch=74, adaptive_threshold=70, max_queue=200)
    eng = Engine(backend, epoch, Switch(policy)).start()
    rng = np.random.default_rng(12)
    d = eng.epoch.matrix.domain_bits
    try:
        assert eng.health()["pass_queries"] == eng.snapshot()["pass_queries"] == 58
        applied = eng.policies()["interactive"]
        assert (applied.name, applied.max_batch, applied.adaptive_threshold) == ("wide", 58, 58)
        assert eng.policies()["interactive"] is applied  # cut once, not at every decision
        assert eng.launch_cap("interactive") == 58
        first = eng.submit([_query(1, d, rng)[0]])  # launched, held at the gate
        assert backend.started.acquire(timeout=10)
        requests = [[_query(t, d, rng)[0]] * 2 for t in range(37)]  # 74 queries queue behind it
        queued = [eng.submit(request) for request in requests]
        backend.gate.set()
        assert len(first.result(30).pages) == 1
        for future, request in zip(queued, requests):
            assert _answered(future.result(30)) == _expected(random_matrix(64, seed=4), request)
        # 1 query, then a full launch of 29 whole requests (58 queries), then the 16 left
        assert [keys // 3 for keys, _ in backend.dispatches] == [1, 58, 16]
        assert eng.snapshot()["launch_reasons"]["full"] == 1
    finally:
        backend.gate.set()
        eng.stop()
    # the policy itself keeps the operator's 74: a backend serving that many a pass launches it
    wide = Engine(NumpyBackend(workers=1), epoch, Switch(policy))
    assert wide.policies()["interactive"] is policy and wide.pass_queries == 74
    wide.stop()


def test_warm_up_runs_the_batch_sizes_a_launch_may_hold():
    class Shapes(NumpyBackend):
        warm_all_shapes = True  # as CUDA: every batch size is launched once before serving
        pass_queries = 4

    backend = Shapes(workers=1)
    eng = Engine(backend, ServedEpoch(epoch_id=1, matrix=random_matrix(64, seed=4)),
                 Switch(LanePolicy(max_batch=8))).start()
    sizes = []
    resident = eng._resident
    answer = resident.answer
    resident.answer = lambda keys, dispatch=DispatchShape(): sizes.append(len(keys) // 3) or answer(keys, dispatch)
    try:
        eng.warm_up(max_batch=8).result(60)
        assert max(sizes) == 4 and set(sizes) == {1, 2, 3, 4}
    finally:
        eng.stop()


def test_a_cancelled_request_does_not_stop_the_engine():
    eng, backend = _gated_engine(LanePolicy(max_batch=1))
    rng = np.random.default_rng(8)
    d = eng.epoch.matrix.domain_bits
    try:
        first_keys = _query(1, d, rng)[0]
        first = eng.submit([first_keys])  # launched, held at the gate
        assert backend.started.acquire(timeout=10)
        waiting = eng.submit([_query(2, d, rng)[0]])
        assert waiting.cancel()  # a caller that stopped waiting
        backend.gate.set()
        assert first.result(30).epoch_id == 1
        later_keys = _query(3, d, rng)[0]
        later = eng.submit([later_keys])
        assert later.result(30).epoch_id == 1
        assert _answered(first.result(30)) == _expected(random_matrix(64, seed=4), [first_keys])
        assert _answered(later.result(30)) == _expected(random_matrix(64, seed=4), [later_keys])
        assert eng.health()["running"] is True
    finally:
        backend.gate.set()
        eng.stop()


def test_a_dead_scheduler_fails_waiting_requests_and_says_why(monkeypatch):
    import gpu_engine.engine as engine_module

    def broken_decide(*args):
        raise TypeError("decide() takes 3 positional arguments but 4 were given")

    monkeypatch.setattr(engine_module, "decide", broken_decide)
    epoch = ServedEpoch(epoch_id=1, matrix=random_matrix(16, seed=0))
    eng = Engine(NumpyBackend(workers=1), epoch)
    rng = np.random.default_rng(9)
    eng.start()
    try:
        try:
            future = eng.submit([_query(1, epoch.matrix.domain_bits, rng)[0]])
        except EngineUnavailable:
            future = None  # the scheduler died before this submit: refused at once, also right
        if future is not None:
            with pytest.raises(EngineUnavailable, match="engine scheduler failed: TypeError"):
                future.result(10)
        eng._thread.join(10)
        health = eng.health()
        assert health["running"] is False
        assert "decide() takes 3 positional arguments" in health["failure"]
        with pytest.raises(EngineUnavailable, match="engine scheduler failed"):
            eng.submit([_query(2, epoch.matrix.domain_bits, rng)[0]])
    finally:
        eng.stop()


def test_a_row_write_queued_when_the_engine_stops_fails_instead_of_hanging():
    eng, backend = _gated_engine(LanePolicy(max_batch=1))
    rng = np.random.default_rng(10)
    d = eng.epoch.matrix.domain_bits
    running = eng.submit([_query(1, d, rng)[0]])  # launched, held at the gate
    assert backend.started.acquire(timeout=10)
    write = eng.write_rows({3: b"\x11" * 256})  # waits for the launch to end
    stopper = threading.Thread(target=eng.stop)
    stopper.start()
    try:
        with pytest.raises(EngineUnavailable, match="engine stopped"):
            write.result(10)
    finally:
        backend.gate.set()
        stopper.join(30)
    with pytest.raises(EngineUnavailable, match="engine stopped"):  # stop frees its device
        running.result(10)

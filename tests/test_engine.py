"""The Engine: answers, coalescing across concurrent submitters, row writes and epoch switches."""
import threading

import numpy as np
import pytest

from gpu_engine.backends.cpu import NumpyBackend
from gpu_engine.dpf import gen_keys
from gpu_engine.engine import Engine, EngineUnavailable
from gpu_engine.matrix import Epoch, random_matrix
from gpu_engine.scheduler import BatchingPolicy, LaneQueue, Launch, Wait, decide, take_requests


def _query(target, d, rng):
    """Three key pairs (target plus two decoys), as a client would make them."""
    pairs = [gen_keys(int(t), d, rng) for t in (target, rng.integers(1 << d), rng.integers(1 << d))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


@pytest.fixture
def engine():
    epoch = Epoch(epoch_id=3, matrix=random_matrix(300, seed=1))
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


def test_row_write_is_in_every_later_answer(engine):
    rng = np.random.default_rng(2)
    d = engine.epoch.matrix.domain_bits
    engine.write_rows({5 * 16 + 2: b"\xee" * 256}).result(10)
    q0, q1 = _query(5, d, rng)
    page = bytes(x ^ y for x, y in zip(engine.answer([q0]).pages[0][0], engine.answer([q1]).pages[0][0]))
    assert page[2 * 256 : 3 * 256] == b"\xee" * 256


def test_bad_row_write_is_refused_before_queueing(engine):
    with pytest.raises(ValueError, match="expected 256"):
        engine.write_rows({1: b"short"})


def test_epoch_switch_is_atomic_per_request(engine):
    rng = np.random.default_rng(3)
    new = Epoch(epoch_id=4, matrix=random_matrix(300, seed=2))
    d = new.matrix.domain_bits
    engine.switch_epoch(new).result(30)
    q0, q1 = _query(9, d, rng)
    a, b = engine.answer([q0]), engine.answer([q1])
    assert a.epoch_id == b.epoch_id == 4
    assert bytes(x ^ y for x, y in zip(a.pages[0][0], b.pages[0][0])) == new.matrix.page(9)


def test_submit_validates_and_refuses_when_stopped():
    epoch = Epoch(epoch_id=1, matrix=random_matrix(4, seed=0))
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


def test_decide_takes_whole_requests_up_to_the_cap_and_interactive_first():
    policies = {"interactive": BatchingPolicy(max_batch=8), "bulk": BatchingPolicy(max_batch=32)}
    queues = [LaneQueue("interactive", (3, 3, 3), 1.0), LaneQueue("bulk", (32,), 0.5)]
    assert decide(queues, policies, 2.0) == Launch("interactive", 2, 6)
    assert decide([LaneQueue("interactive", (), None), queues[1]], policies, 2.0) == Launch("bulk", 1, 32)
    assert decide([LaneQueue("interactive", (), None)], policies, 2.0) == Wait(None)
    assert take_requests((40,), 32) == (1, 40)  # an oversized request still goes, alone


def test_policy_bounds():
    with pytest.raises(ValueError, match="max_batch must be in 1..32, got 0"):
        BatchingPolicy(max_batch=0)

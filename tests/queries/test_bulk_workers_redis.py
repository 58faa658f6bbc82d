"""Bulk jobs through real processes over the Redis broker, a Redis of the test's own restarted or
killed in the middle of a 1,000-query job whose every answer is checked."""

from __future__ import annotations

import time

import pytest

from tests.conftest import redis_reachable
from tests.queries.bulk_stack import QUERIES, check_results, stack, submit, workload  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes


@pytest.mark.skipif(not redis_reachable(), reason="no Redis on 127.0.0.1:6379")
def test_redis_broker_worker_answers_a_1000_query_job(stack, workload):
    s = stack("redis://127.0.0.1:6379/14")
    s.start_workers()
    check_results(s, submit(s, workload), workload)


def test_redis_restarted_mid_job_the_job_completes(stack, workload, own_redis):
    s = stack(own_redis.url)
    s.start_workers()
    job_id = submit(s, workload)
    s.wait(job_id, lambda j: j["answered"] >= 160)
    own_redis.stop()  # every queued message is gone with it
    time.sleep(1.0)
    own_redis.start()
    check_results(s, job_id, workload)


def test_broker_killed_mid_job_costs_at_most_30_s_of_progress(stack, workload, own_redis):
    # Lost messages are resent only after an hour of no progress: what moves the job again is
    # the workers noticing the broker coming back.
    s = stack(own_redis.url, MORPHO_BULK_REQUEUE_SECONDS=3600, MORPHO_BULK_SWEEP_SECONDS=5)
    s.start_workers()
    job_id = submit(s, workload)
    s.wait(job_id, lambda j: j["answered"] >= 160 and s.running_chunks() == 1)
    own_redis.kill()
    killed_at = s.job(job_id)["answered"]
    time.sleep(1.0)
    own_redis.start()
    restarted = time.monotonic()
    # The chunk computing at the kill may still be stored; a second one needs a message the new
    # broker did not have.
    s.wait(job_id, lambda j: j["answered"] >= killed_at + 2 * 32, timeout=60)
    assert time.monotonic() - restarted <= 30, s.logs()
    assert killed_at < QUERIES
    check_results(s, job_id, workload)
    # A task chains the next chunks without the broker, so the job can finish before the worker's
    # consumer has reconnected: the worker says so once it has, within its reconnect interval.
    said = "connected to the broker again; resending bulk chunks it may have lost"
    deadline = time.monotonic() + 30
    while said not in (log := (s.tmp / "workers-0.log").read_text(errors="replace")):
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.5)

"""`/metrics`: HTTP query counts and durations, engine batching figures and the active policies."""
from __future__ import annotations

import json
import re
import threading

import pytest
from rest_framework.test import APIClient

from morpho_pir.dpf import gen_keys
from gpu_engine.engine_stats import Histogram
from engine.holder import get_engine
from engine.metrics import EngineCollector

pytestmark = pytest.mark.django_db

D = 8  # the vector matrix: 200 pages


def sample(text: str, metric: str, **labels) -> float:
    """The value of one sample in Prometheus text format; fails when it is not there."""
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != metric:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(4))
    raise AssertionError(f"no sample {metric}{labels} in /metrics")


def keys_hex(rng_target: int):
    return ["0x" + gen_keys(t, D)[0].to_bytes().hex() for t in (rng_target, 1, 2)]


@pytest.fixture
def api(serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    return APIClient()


def test_metrics_count_queries_time_them_and_show_the_engine(api):
    before = api.get("/metrics").content.decode()

    def count(text, endpoint):
        try:
            return sample(text, "pir_query_count_total", endpoint=endpoint)
        except AssertionError:
            return 0.0

    response = api.post("/query/page/gpu", json.dumps({"keys": keys_hex(7)}), content_type="application/json")
    assert response.status_code == 200
    body = {"queries": [{"keys": keys_hex(t)} for t in (3, 4, 5)]}
    response = api.post("/query/page/gpu/batch", json.dumps(body), content_type="application/json")
    assert response.status_code == 200
    bad = api.post("/query/page/gpu", json.dumps({"keys": ["0x00"]}), content_type="application/json")
    assert bad.status_code == 400

    text = api.get("/metrics").content.decode()
    assert count(text, "/query/page/gpu") - count(before, "/query/page/gpu") == 1  # the 400 is not counted
    assert count(text, "/query/page/gpu/batch") - count(before, "/query/page/gpu/batch") == 3
    assert sample(text, "pir_query_duration_seconds_count", endpoint="/query/page/gpu") >= 2  # timed, 400 too
    assert sample(text, "gpu_batch_dispatch_mode_total", mode="latency") >= 2
    assert sample(text, "gpu_batch_launches_total") >= 2
    assert sample(text, "gpu_queries_answered_total", lane="interactive") >= 4
    assert sample(text, "gpu_batch_size_queries_count") >= 2
    assert sample(text, "gpu_batch_size_queries_bucket", le="+Inf") >= 2
    assert sample(text, "pir_queue_depth", lane="interactive") == 0
    assert sample(text, "pir_queue_wait_seconds_count", lane="interactive") >= 4
    assert sample(text, "pir_compute_seconds_count", lane="interactive") >= 2
    assert 0 <= sample(text, "gpu_held_idle_seconds_total", lane="interactive") < 1  # latency holds nothing
    assert sample(text, "gpu_cost_model", parameter="samples") >= 2
    assert sample(text, "pir_arrival_rate_per_second", lane="interactive") > 0
    assert sample(text, "pir_latency_p95_last_minute_seconds", lane="interactive") > 0
    assert sample(text, "pir_batching_policy_info", lane="interactive", name="interactive-latency",
                  mode="latency") == 1
    assert sample(text, "pir_batching_policy_info", lane="bulk", name="bulk-throughput") == 1
    assert get_engine().policies()["interactive"].name == "interactive-latency"


class _Refusing:
    """An engine stand-in whose snapshot holds refusals, for the collector alone."""

    running = True
    held = None

    def snapshot(self):
        empty = Histogram((1.0,)).snapshot()
        lane = {"queries": 0, "refused": {"queue_full": 5, "deadline": 2}, "queued": 7, "arrival_rate": 3.0,
                "p95_last_minute_s": float("nan"), "queue_wait": empty, "compute": empty,
                "held_seconds": 1.5}
        return {"dispatch_modes": {"slo": 4}, "launch_reasons": {"window": 4}, "batch_size": empty,
                "launches": 4, "lanes": {"interactive": lane},
                "cost": {"intercept_s": 0.002, "per_query_s": 0.0005, "samples": 4, "rmse_s": 0.0}}


def test_collector_exports_refusals_by_reason_and_fit_parameters():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: _Refusing(), lambda: {}))
    text = generate_latest(registry).decode()
    assert sample(text, "pir_refusals_total", lane="interactive", reason="queue_full") == 5
    assert sample(text, "pir_refusals_total", lane="interactive", reason="deadline") == 2
    assert sample(text, "gpu_cost_model", parameter="intercept_s") == 0.002
    assert sample(text, "gpu_cost_model", parameter="per_query_s") == 0.0005
    assert sample(text, "gpu_batch_dispatch_mode_total", mode="slo") == 4
    assert sample(text, "gpu_held_idle_seconds_total", lane="interactive") == 1.5
    assert sample(text, "pir_engine_up") == 1
    assert "pir_latency_p95_last_minute_seconds{" not in text  # no answers yet: no figure


def test_the_policy_metric_shows_max_batch_as_the_engine_applies_it(api):
    from gpu_engine.engine import static_policy
    from gpu_engine.scheduler import LanePolicy

    engine = get_engine()  # this test's own: serve_matrix stops it afterwards
    engine.pass_queries = 8  # as a backend whose scan serves 8 queries a pass over its matrix
    engine.set_policy_source(static_policy(LanePolicy(name="wide", max_batch=32, adaptive_threshold=20)))
    text = api.get("/metrics").content.decode()
    assert sample(text, "pir_batching_policy_info", lane="interactive", name="wide", max_batch="8") == 1
    assert 'max_batch="32"' not in text
    applied = engine.policies()["interactive"]
    assert (applied.max_batch, applied.adaptive_threshold) == (8, 8)


def test_full_queue_is_a_503_with_retry_after_and_counted_by_reason(api, monkeypatch):
    from gpu_engine.engine import static_policy
    from gpu_engine.scheduler import LanePolicy

    engine = get_engine()  # this test's own: serve_matrix stops it afterwards
    engine.set_policy_source(static_policy(LanePolicy(name="tiny", max_batch=1, max_queue=1)))
    gate, started = threading.Event(), threading.Event()
    answer = engine._resident.answer

    def held(keys, dispatch):
        started.set()
        gate.wait(30)
        return answer(keys, dispatch)

    monkeypatch.setattr(engine._resident, "answer", held)
    query = [gen_keys(t, D)[0] for t in (1, 2, 3)]
    try:
        running = engine.submit([query])  # on the device, held
        assert started.wait(10)
        queued = engine.submit([query])  # fills the queue of 1
        response = api.post("/query/page/gpu", json.dumps({"keys": keys_hex(9)}), content_type="application/json")
        assert response.status_code == 503
        assert int(response["Retry-After"]) >= 1
        assert response.json()["detail"] == ("interactive queue is full: 1 queries queued, 1 more would "
                                             "pass the policy's max_queue of 1")
    finally:
        gate.set()
    assert running.result(30) and queued.result(30)
    text = api.get("/metrics").content.decode()
    assert sample(text, "pir_refusals_total", lane="interactive", reason="queue_full") >= 1

"""Prometheus metrics (django-prometheus's registry, `/metrics`): HTTP query counts and durations,
and the engine's stats and active policies turned into metric families at scrape time."""
from __future__ import annotations

import functools
import math
import threading
import time
from typing import Callable, Iterable, Optional

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from gpu_engine.engine import EngineBusy
from gpu_engine.engine_stats import SECONDS_BOUNDS

QUERY_COUNT = Counter("pir_query_count", "PIR queries answered over HTTP, by endpoint "
                      "(a batch request counts each of its queries).", ["endpoint"])
QUERY_DURATION = Histogram("pir_query_duration_seconds", "Time from request to response of a PIR "
                           "query endpoint, by endpoint.", ["endpoint"], buckets=SECONDS_BOUNDS)


def observe_query(endpoint: str, queries: Callable[[object], int] = lambda response: 1):
    """Decorate a view method: count `queries(response)` answered queries and time the request.

    Only successful responses (status < 400) count as answered queries; every request is timed."""
    def decorate(view_method):
        @functools.wraps(view_method)
        def wrapper(self, request, *args, **kwargs):
            started = time.perf_counter()
            try:
                response = view_method(self, request, *args, **kwargs)
            finally:
                QUERY_DURATION.labels(endpoint).observe(time.perf_counter() - started)
            if getattr(response, "status_code", 500) < 400:
                QUERY_COUNT.labels(endpoint).inc(queries(response))
            return response
        return wrapper
    return decorate


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _histogram(family: HistogramMetricFamily, labels, snapshot: dict) -> None:
    family.add_metric(labels, [(_le(b), c) for b, c in snapshot["buckets"]], snapshot["sum"])


class EngineCollector:
    """Reads this process's engine snapshot and live policies on each scrape; builds no engine."""

    def __init__(self, engine_fn: Callable[[], Optional[object]], policies_fn: Callable[[], dict]) -> None:
        self._engine_fn = engine_fn
        self._policies_fn = policies_fn

    def collect(self) -> Iterable:
        info = InfoMetricFamily("pir_batching_policy", "The batching policy in force per lane.",
                                labels=["lane"])
        for lane, policy in sorted(self._policies_fn().items()):
            info.add_metric([lane], {"name": policy.name, "mode": policy.mode,
                                     "max_batch": str(policy.max_batch),
                                     "window_us": str(policy.window_us),
                                     "p95_target_ms": f"{policy.p95_target_ms:g}"})
        yield info
        engine = self._engine_fn()
        if engine is None:
            return
        up = GaugeMetricFamily("pir_engine_up", "1 while this process's engine (in process, or the "
                               "engine server it submits to) takes queries, else 0.")
        up.add_metric([], 1 if engine.running else 0)
        yield up
        try:
            snap = engine.snapshot()
        except EngineBusy:  # the engine server is away: /health says so, a scrape still works
            return
        yield from self._engine_families(snap)

    def _engine_families(self, snap: dict) -> Iterable:
        modes = CounterMetricFamily("gpu_batch_dispatch_mode", "Launches by the mode of the policy "
                                    "that decided them.", labels=["mode"])
        for mode, count in sorted(snap["dispatch_modes"].items()):
            modes.add_metric([mode], count)
        reasons = CounterMetricFamily("gpu_batch_launch_reason", "Launches by why they went "
                                      "(now, full, window, starvation, warmup).", labels=["reason"])
        for reason, count in sorted(snap["launch_reasons"].items()):
            reasons.add_metric([reason], count)
        sizes = HistogramMetricFamily("gpu_batch_size_queries", "Queries per launch.")
        _histogram(sizes, [], snap["batch_size"])
        launches = CounterMetricFamily("gpu_batch_launches", "Launches run on the device.")
        launches.add_metric([], snap["launches"])
        answered = CounterMetricFamily("gpu_queries_answered", "Queries answered by the engine.",
                                       labels=["lane"])
        refused = CounterMetricFamily("pir_refusals", "Queries refused (503), by reason: queue_full, "
                                      "deadline, stopped, device_error.", labels=["lane", "reason"])
        depth = GaugeMetricFamily("pir_queue_depth", "Queries queued now.", labels=["lane"])
        rate = GaugeMetricFamily("pir_arrival_rate_per_second", "Recent arrival rate (EMA).",
                                 labels=["lane"])
        p95 = GaugeMetricFamily("pir_latency_p95_last_minute_seconds", "p95 of engine latency "
                                "(arrival to answer) over the last minute.", labels=["lane"])
        wait = HistogramMetricFamily("pir_queue_wait_seconds", "Per query: arrival to launch start.",
                                     labels=["lane"])
        compute = HistogramMetricFamily("pir_compute_seconds", "Per launch: device time.", labels=["lane"])
        held = CounterMetricFamily("gpu_held_idle_seconds", "Device idle while a query of the lane "
                                   "waited: the time batching policies spend holding for a fuller "
                                   "batch.", labels=["lane"])
        for lane, data in sorted(snap["lanes"].items()):
            answered.add_metric([lane], data["queries"])
            for reason, count in sorted(data["refused"].items()):
                refused.add_metric([lane, reason], count)
            depth.add_metric([lane], data.get("queued", 0))
            rate.add_metric([lane], data.get("arrival_rate", 0.0))
            if not math.isnan(data["p95_last_minute_s"]):
                p95.add_metric([lane], data["p95_last_minute_s"])
            _histogram(wait, [lane], data["queue_wait"])
            _histogram(compute, [lane], data["compute"])
            held.add_metric([lane], data["held_seconds"])
        cost = GaugeMetricFamily("gpu_cost_model", "Launch cost fit t(b) = intercept + per_query * b "
                                 "(seconds) and the launches it is fitted from.", labels=["parameter"])
        for name in ("intercept_s", "per_query_s", "samples", "rmse_s"):
            cost.add_metric([name], snap["cost"][name])
        return [modes, reasons, sizes, launches, answered, refused, depth, rate, p95, wait, compute, held, cost]


_registered = False
_lock = threading.Lock()


def register_collector(registry=REGISTRY) -> None:
    """Export the engine and policy metrics from this process's registry (once)."""
    global _registered
    with _lock:
        if _registered:
            return

        def engine():
            from morphoweb.engine_runtime import peek_engine
            return peek_engine()

        def policies():
            from morphoweb.engine_runtime import is_remote, peek_engine
            from policies.bridge import current_policies

            engine = peek_engine()
            if engine is not None and is_remote():
                try:
                    return engine.policies()  # the engine server's, as of its last PONG
                except EngineBusy:
                    return {}
            return current_policies()

        registry.register(EngineCollector(engine, policies))
        _registered = True

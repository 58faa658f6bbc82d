"""Prometheus metrics of the engine (`/metrics`): its stats and the batching policies in force,
turned into metric families at scrape time; and the registry that /metrics and the dashboard read,
the party's figures over all its web processes."""
from __future__ import annotations

import math
import os
import threading
from typing import Callable, Dict, Iterable, List, Optional

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from engine.holder import peek_engine
from gpu_engine.engine import EngineBusy
from gpu_engine.interface import QueryEngine
from gpu_engine.scheduler import LanePolicy


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _histogram(family: HistogramMetricFamily, labels, snapshot: dict) -> None:
    family.add_metric(labels, [(_le(b), c) for b, c in snapshot["buckets"]], snapshot["sum"])


class EngineCollector:
    """Reads this process's engine snapshot and live policies on each scrape; builds no engine."""

    def __init__(self, engine_fn: Callable[[], Optional[QueryEngine]],
                 policies_fn: Callable[[], dict]) -> None:
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
        up.add_metric([], 1 if engine.running and not engine.held else 0)
        yield up
        try:
            snap = engine.snapshot()
        except EngineBusy:  # the engine server is away: /health says so, a scrape still works
            return
        yield from self._engine_families(snap)

    def _engine_families(self, snap: dict) -> Iterable:
        layout = InfoMetricFamily("pir_engine_layout", "How the engine's backend stores the matrix "
                                  "(MORPHO_MATRIX_LAYOUT) and why.")
        layout.add_metric([], {"backend": str(snap.get("backend", "")),
                               "layout": str(snap.get("layout", "")),
                               "reason": str(snap.get("layout_reason", "")),
                               "pass_queries": str(snap.get("pass_queries", ""))})
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
                                      "deadline, stopped, device_error, held (the party's active epoch cannot be served).",
                                      labels=["lane", "reason"])
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
        return [layout, modes, reasons, sizes, launches, answered, refused, depth, rate, p95, wait,
                compute, held, cost, *_device_families(snap.get("placement", {}))]


def _device_families(placed: dict) -> Iterable:
    """Per device of an engine that owns several (gpu_engine.placement): launches, busy time and
    the bytes of the epoch it holds, labelled by device; nothing for an engine of one device."""
    devices = placed.get("devices") or []
    if not devices:
        return []
    launches = CounterMetricFamily("gpu_device_launches", "Launches run on each device (a sharded "
                                   "batch runs on every device).", labels=["device", "placement"])
    busy = CounterMetricFamily("gpu_device_busy_seconds", "Seconds each device spent on batches, "
                               "start (or the previous batch's end) to collection.",
                               labels=["device", "placement"])
    held = GaugeMetricFamily("gpu_device_resident_bytes", "Bytes of the served epoch each device "
                             "holds.", labels=["device", "placement"])
    for device in devices:
        labels = [device["device"], placed["placement"]]
        launches.add_metric(labels, device["launches"])
        busy.add_metric(labels, device["busy_seconds"])
        held.add_metric(labels, device["resident_bytes"])
    return [launches, busy, held]


# Functions that return the policies this process applies ({lane: policy}), filled in by the
# policies app's ready(); read where the engine is in this process (or there is none yet).
_policy_readers: List[Callable[[], Dict[str, LanePolicy]]] = []


def read_policies_with(reader: Callable[[], Dict[str, LanePolicy]]) -> None:
    """Let the collector report `reader()`'s policies (called from AppConfig.ready)."""
    _policy_readers.append(reader)


def policies_in_force() -> Dict[str, LanePolicy]:
    """The policies this process applies: its engine's, as applied (max_batch cut to the
    backend's pass_queries; the engine server's as of its last PONG where the engine is remote),
    else, before an engine exists, those the registered readers report; never reads the database."""
    engine = peek_engine()
    if engine is not None:
        try:
            return engine.policies()
        except EngineBusy:
            return {}
    policies: Dict[str, LanePolicy] = {}
    for reader in _policy_readers:
        policies.update(reader())
    return policies


_registered: dict = {}  # name -> the collector registered under it
_lock = threading.Lock()
_party: Optional[CollectorRegistry] = None


def register_once(name: str, make_collector: Callable[[], object], registry=REGISTRY) -> None:
    """Export `make_collector()` from this process's registry and the party's, once per `name`
    (an app's ready() may run again in tests)."""
    with _lock:
        if name not in _registered:
            _registered[name] = collector = make_collector()
            registry.register(collector)
            if _party is not None:
                _party.register(collector)


def party_registry() -> CollectorRegistry:
    """The registry `/metrics` and the dashboard read. Under gunicorn (gunicorn.conf.py sets
    PROMETHEUS_MULTIPROC_DIR before any web process starts), each web process keeps its
    counters and histograms in files there, and this registry adds them up over every process,
    the ones that have ended included, so a counter only grows whichever process is asked; the
    collectors registered here read the engine server and the database, the party's already.
    Without that folder (runserver, the tests, a shell): this process's own registry."""
    global _party
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    with _lock:
        if _party is None:
            _party = CollectorRegistry()
            MultiProcessCollector(_party)
            for collector in _registered.values():
                _party.register(collector)
        return _party


def register_collector() -> None:
    """Export the engine and policy metrics from this process's registry (once)."""
    register_once("engine", lambda: EngineCollector(peek_engine, policies_in_force))

"""The operator dashboard (staff only): one page, fed every second by a JSON view of the very
figures `/metrics` exports (the party's, over all its web processes: engine.metrics.party_registry),
plus a few database rows, and the last 15 minutes of per-second figures that this process samples
from them. The database rows come
from the apps that own them (epochs, queries), which add their figures from their ready()."""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Callable

from django.contrib.admin.views.decorators import staff_member_required
from django.db import close_old_connections
from django.http import JsonResponse
from django.shortcuts import render

from engine.json_errors import header_error
from engine.metrics import party_registry

# Metric families the page reads (names as registered; samples carry _info, _bucket, ... suffixes).
FAMILIES = (
    "pir_batching_policy", "pir_arrival_rate_per_second", "pir_queue_depth", "gpu_batch_size_queries",
    "pir_query_duration_seconds", "pir_query_count", "pir_latency_p95_last_minute_seconds",
    "pir_device_memory_bytes", "pir_epoch", "pir_row_updates_pending", "gpu_queries_answered",
    "gpu_device_launches", "gpu_device_busy_seconds", "gpu_device_resident_bytes",
    "pir_engine_layout",
)
HISTORY_SECONDS = 15 * 60  # per-second points kept server-side and drawn when the page loads
SAMPLE_EVERY_S = 1.0

log = logging.getLogger(__name__)


def _number(value):
    # JSON has no inf/nan: an infinite bucket bound is written "+Inf", as in /metrics.
    if isinstance(value, float) and math.isinf(value):
        return "+Inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _samples(registry):
    wanted = set(FAMILIES)
    for family in registry.collect():
        if family.name in wanted:
            for sample in family.samples:
                yield family.name, sample


def _buckets(samples):
    """Cumulative (le, count) pairs summed over label sets, in bound order."""
    totals = {}
    for sample in samples:
        le = sample.labels["le"]
        totals[le] = totals.get(le, 0) + sample.value
    ordered = sorted(totals.items(), key=lambda item: math.inf if item[0] == "+Inf" else float(item[0]))
    return [[le, count] for le, count in ordered]


def metric_figures(registry=None) -> dict:
    """What the page plots, read from the registry `/metrics` exports (the party's, by default);
    None where absent."""
    by_family = {}
    for name, sample in _samples(registry or party_registry()):
        by_family.setdefault(name, []).append(sample)

    def per_lane(family, suffix=""):
        samples = [s for s in by_family.get(family, []) if s.name == family + suffix]
        return {s.labels.get("lane", ""): _number(s.value) for s in samples} if samples else None

    policies = {s.labels["lane"]: {k: v for k, v in s.labels.items() if k != "lane"}
                for s in by_family.get("pir_batching_policy", []) if s.name.endswith("_info")}
    epoch = next((dict(s.labels) for s in by_family.get("pir_epoch", []) if s.name.endswith("_info")), None)
    pending = next((s.value for s in by_family.get("pir_row_updates_pending", [])), None)
    layout = next((dict(s.labels) for s in by_family.get("pir_engine_layout", [])
                   if s.name.endswith("_info")), None)
    memory = {s.labels["kind"]: s.value for s in by_family.get("pir_device_memory_bytes", [])} or None
    latency = [s for s in by_family.get("pir_query_duration_seconds", []) if s.name.endswith("_bucket")]
    sizes = [s for s in by_family.get("gpu_batch_size_queries", []) if s.name.endswith("_bucket")]
    queries = [s.value for s in by_family.get("pir_query_count", []) if s.name.endswith("_total")]
    devices: dict = {}  # device -> its figures, for an engine that owns several
    for family, figure in (("gpu_device_launches", "launches"), ("gpu_device_busy_seconds", "busy_s"),
                           ("gpu_device_resident_bytes", "resident")):
        for s in by_family.get(family, []):
            if s.name in (family, family + "_total"):
                entry = devices.setdefault(s.labels["device"], {"placement": s.labels["placement"]})
                entry[figure] = _number(s.value)
    return {
        "policies": policies or None,
        "arrival_rate": per_lane("pir_arrival_rate_per_second"),
        "queue_depth": per_lane("pir_queue_depth"),
        "engine_p95_s": per_lane("pir_latency_p95_last_minute_seconds"),
        "answered": per_lane("gpu_queries_answered", "_total"),
        "http_queries": sum(queries) if queries else None,
        "latency_buckets": _buckets(latency) if latency else None,
        "batch_size_buckets": _buckets(sizes) if sizes else None,
        "memory": memory,
        "layout": layout,
        "devices": [{"device": name, **figures} for name, figures in sorted(devices.items())] or None,
        "epoch": epoch,
        "pending_updates": pending,
    }


def _bound(le) -> float:
    return math.inf if le == "+Inf" else float(le)


def quantile(q: float, before, after) -> float | None:
    """The q-quantile of the observations between two cumulative histograms, as Prometheus'
    histogram_quantile does: linear within the bucket the rank falls in; None without any."""
    if not after:
        return None
    prior = {le: count for le, count in (before or [])}
    deltas = [(_bound(le), count - prior.get(le, 0)) for le, count in after]
    total = deltas[-1][1] if deltas else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0
    for upper, cumulative in deltas:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            share = 0 if cumulative == below else (rank - below) / (cumulative - below)
            return lower + (upper - lower) * share
        lower, below = upper, cumulative
    return lower


class History:
    """This process's per-second figures over the last HISTORY_SECONDS, sampled by one daemon
    thread from the registry `/metrics` exports, so a page opened (or reloaded) now draws the last
    15 minutes at once."""

    def __init__(self, registry=None, seconds: int = HISTORY_SECONDS) -> None:
        self.registry = registry
        self.points: deque = deque(maxlen=seconds)
        self._buckets = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def sample(self, now: float | None = None) -> dict:
        """Add one point: HTTP latency p50/p95 of the queries answered since the last point,
        arrival rate and queue depth per lane, and the interactive policy's p95 target."""
        figures = metric_figures(self.registry)
        buckets = figures["latency_buckets"]
        policy = (figures["policies"] or {}).get("interactive") or {}
        target_ms = policy.get("p95_target_ms")
        point = {
            "t": round(time.time() if now is None else now, 3),
            "p50": quantile(0.5, self._buckets, buckets),
            "p95": quantile(0.95, self._buckets, buckets),
            "target": float(target_ms) / 1000 if target_ms else None,
            "rate": figures["arrival_rate"] or {},
            "depth": figures["queue_depth"] or {},
        }
        self._buckets = buckets
        with self._lock:
            self.points.append(point)
        return point

    def since(self, t: float | None = None) -> list[dict]:
        with self._lock:
            return [p for p in self.points if t is None or p["t"] > t]

    def start(self) -> None:
        """Start sampling in this process (again in a forked child); idempotent."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="dashboard-history", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self.tick()
            time.sleep(SAMPLE_EVERY_S - time.time() % SAMPLE_EVERY_S)

    def tick(self) -> None:
        """One point, then this thread's database connection closed as a request's is: after
        CONN_MAX_AGE, and at once if a transaction was left open in it. The collectors read the
        database; a thread outside the request cycle that kept a transaction open would hold its
        locks for good (a TRUNCATE, a migration waits on them)."""
        try:
            self.sample()
        except Exception:  # a broken collector must not end the history
            log.exception("dashboard history: sampling failed")
        try:
            close_old_connections()
        except Exception:  # noqa: BLE001 - the next sample connects afresh
            log.exception("dashboard history: closing the database connection failed")


_history = History()


def history() -> History:
    """This process's history, sampling from the first call on (the WSGI app calls it at load)."""
    _history.start()
    return _history


# Functions that return database figures for the page ({name: JSON-able value}), added by the
# apps that own the rows (the active epoch and row updates, bulk jobs) from their ready().
_figure_sources: list[Callable[[], dict]] = []


def add_figures(source: Callable[[], dict]) -> None:
    """Show `source()`'s figures on the page (called from AppConfig.ready)."""
    _figure_sources.append(source)


def database_figures() -> dict:
    """The active epoch record, the latest pending row updates, and bulk jobs still running
    (None where the app that keeps them is not installed)."""
    data = {"active_record": None, "recent_updates": [], "bulk_jobs": None}
    for source in _figure_sources:
        data.update(source())
    return data


def snapshot(since: float | None = None) -> dict:
    """Figures now, plus the history points after `since` (all of them when None)."""
    return {"time": time.time(), "pid": os.getpid(), **metric_figures(), **database_figures(),
            "history_seconds": HISTORY_SECONDS, "history": history().since(since)}


@staff_member_required
def dashboard(request):
    """The page; it draws the first snapshot (with the whole history) at once and then polls
    `dashboard_data` for what is new."""
    return render(request, "dashboard.html", {"snapshot": snapshot(), "title": "Operator dashboard"})


@staff_member_required
def dashboard_data(request):
    raw = request.GET.get("since")
    try:
        since = float(raw) if raw else None
        if since is not None and not math.isfinite(since):
            raise ValueError(raw)
    except ValueError:
        return header_error(400, "since", "invalid",
                            f"expected the time of the last point seen (Unix seconds), got {raw!r}")
    return JsonResponse(snapshot(since))

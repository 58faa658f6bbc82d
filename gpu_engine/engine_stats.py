"""What the engine measured, as plain data: counters, histograms and last-minute figures per lane."""
from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from typing import TYPE_CHECKING, Deque, Dict, List, Sequence, Tuple

if TYPE_CHECKING:
    from gpu_engine.scheduler import Launch

BATCH_BOUNDS = (1, 2, 4, 8, 16, 24, 32, 42, 58, 64, 74)  # queries per launch (up to MAX_LAUNCH_QUERIES)
SECONDS_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0, 30.0)
RECENT_S = 60.0  # "the last minute" of the admin's live figures
RECENT_MAX = 100_000  # bound on remembered answers, whatever the rate


class Histogram:
    """Counts under fixed upper bounds plus sum and count: what a Prometheus histogram exports."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def snapshot(self) -> dict:
        """{"buckets": [(upper bound, cumulative count), ..., (inf, count)], "sum", "count"}."""
        cumulative, total = [], 0
        for bound, count in zip(self.bounds + (math.inf,), self.counts):
            total += count
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of values; nan when there are none."""
    return quantiles(values, (q,))[0]


def quantiles(values: Sequence[float], qs: Sequence[float]) -> List[float]:
    """percentile() of each q in qs, sorting the values once."""
    if not values:
        return [math.nan] * len(qs)
    ordered = sorted(values)
    return [ordered[max(0, math.ceil(q * len(ordered)) - 1)] for q in qs]


class LaneStats:
    """One lane's counters and distributions since start."""

    def __init__(self) -> None:
        self.queries = 0  # queries answered
        self.requests = 0  # requests answered
        self.launches = 0
        self.held_seconds = 0.0  # device idle while a query of this lane waited, summed per launch
        self.launches_held = 0  # launches the scheduler held back at least once for a fuller batch
        self.queue_wait = Histogram(SECONDS_BOUNDS)  # per query: arrival to launch start
        self.compute = Histogram(SECONDS_BOUNDS)  # per launch: the backend's time
        self.latency = Histogram(SECONDS_BOUNDS)  # per query: arrival to answer
        self.refused: Dict[str, int] = {}  # reason -> queries refused
        # (done, latency) per answered request and (done, batch) per launch, the last minute
        self.recent_latency: Deque[Tuple[float, float]] = deque(maxlen=RECENT_MAX)
        self.recent_batches: Deque[Tuple[float, int]] = deque(maxlen=RECENT_MAX)


class EngineStats:
    """Updated by the scheduler thread and by refused submitters; read as a snapshot."""

    def __init__(self, lanes: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self.launches = 0
        self.queries_answered = 0
        self.requests_answered = 0
        self.failures = 0  # launches that failed on the device
        self.last_batch_queries = 0
        self.compute_seconds = 0.0
        self.batch_size = Histogram(BATCH_BOUNDS)
        self.dispatch_modes: Dict[str, int] = {}  # policy mode that decided -> launches
        self.launch_reasons: Dict[str, int] = {}  # now | full | window | starvation | warmup -> launches
        self.lanes: Dict[str, LaneStats] = {lane: LaneStats() for lane in lanes}

    def _lane(self, lane: str) -> LaneStats:
        stats = self.lanes.get(lane)
        if stats is None:
            stats = self.lanes[lane] = LaneStats()
        return stats

    @property
    def refused(self) -> Dict[str, int]:
        """Reason -> queries refused, over all lanes."""
        with self._lock:
            total: Dict[str, int] = {}
            for stats in self.lanes.values():
                for reason, count in stats.refused.items():
                    total[reason] = total.get(reason, 0) + count
            return total

    def refuse(self, lane: str, reason: str, queries: int) -> None:
        with self._lock:
            refused = self._lane(lane).refused
            refused[reason] = refused.get(reason, 0) + queries

    def failure(self, lane: str, queries: int) -> None:
        with self._lock:
            self.failures += 1
            refused = self._lane(lane).refused
            refused["device_error"] = refused.get("device_error", 0) + queries

    def launched(self, decision: "Launch", seconds: float,
                 requests: List[Tuple[int, float, float]], done: float, held: float = 0.0,
                 waited: bool = False) -> None:
        """One launch that took `seconds` after the device sat `held` seconds idle with its oldest
        query queued (`waited`: the scheduler chose to wait for it); requests are (queries, queue
        wait, latency)."""
        queries = sum(size for size, _, _ in requests)
        with self._lock:
            lane = self._lane(decision.lane)
            self.launches += 1
            self.queries_answered += queries
            self.requests_answered += len(requests)
            self.last_batch_queries = queries
            self.compute_seconds += seconds
            self.batch_size.observe(queries)
            self.dispatch_modes[decision.mode] = self.dispatch_modes.get(decision.mode, 0) + 1
            self.launch_reasons[decision.reason] = self.launch_reasons.get(decision.reason, 0) + 1
            lane.launches += 1
            lane.held_seconds += held
            lane.launches_held += waited
            lane.queries += queries
            lane.requests += len(requests)
            lane.compute.observe(seconds)
            lane.recent_batches.append((done, queries))
            for size, wait, latency in requests:
                lane.queue_wait.observe(wait, size)
                lane.latency.observe(latency, size)
                lane.recent_latency.append((done, latency))

    def snapshot(self, now: float) -> dict:
        """Plain data: totals, histograms, and per lane the last minute's p95 and mean batch.

        The lock is held only to copy: the scheduler thread takes it after every launch, and
        sorting a minute of latencies (up to RECENT_MAX) under it would stall the device."""
        with self._lock:
            recent = {}
            for name, lane in self.lanes.items():
                for window in (lane.recent_latency, lane.recent_batches):
                    while window and window[0][0] < now - RECENT_S:
                        window.popleft()
                recent[name] = (list(lane.recent_latency), list(lane.recent_batches))
            lanes = {name: {
                "queries": lane.queries, "requests": lane.requests, "launches": lane.launches,
                "held_seconds": lane.held_seconds, "launches_held": lane.launches_held,
                "queue_wait": lane.queue_wait.snapshot(), "compute": lane.compute.snapshot(),
                "latency": lane.latency.snapshot(), "refused": dict(lane.refused),
            } for name, lane in self.lanes.items()}
            data = {
                "launches": self.launches, "queries_answered": self.queries_answered,
                "requests_answered": self.requests_answered, "failures": self.failures,
                "compute_seconds": self.compute_seconds, "batch_size": self.batch_size.snapshot(),
                "dispatch_modes": dict(self.dispatch_modes), "launch_reasons": dict(self.launch_reasons),
                "lanes": lanes,
            }
        for name, (latencies, batches) in recent.items():
            p50, p95 = quantiles([latency for _, latency in latencies], (0.50, 0.95))
            lanes[name].update({
                "p95_last_minute_s": p95, "p50_last_minute_s": p50,
                "mean_batch_last_minute": (sum(size for _, size in batches) / len(batches)
                                           if batches else math.nan),
                "launches_last_minute": len(batches),
            })
        return data

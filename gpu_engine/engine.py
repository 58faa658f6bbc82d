"""The Engine: owns one device, coalesces submitted queries into launches on a scheduler thread."""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from gpu_engine.backends.base import Backend, PendingAnswer, ResidentMatrix
from gpu_engine.choices import LabelledChoice
from gpu_engine.costmodel import FormatCosts, RateMeter
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, DpfKey, KeyBatch, format_name, random_keys
from gpu_engine.engine_stats import EngineStats
from gpu_engine.matrix import ServedEpoch
from gpu_engine.placement import DeviceFailed, check_placeable, describe_placement, load_placed
from morpho_pir.protocol import KEYS_PER_QUERY, MAX_BATCH_QUERIES, PAGE_BYTES
from morpho_pir.state import RowDigest, ServedState
from gpu_engine.scheduler import (
    HEAD_REQUESTS,
    LANES,
    LanePolicy,
    Launch,
    LaneQueue,
    decide,
    expiry_cutoff,
    launch_cap,
    overlaps,
    plan_slo,
)

log = logging.getLogger(__name__)

PolicySource = Callable[[str], LanePolicy]  # lane -> the policy in force now
# Longest the loop sleeps while queries wait, so that a policy swapped by another thread (a
# shorter window, a new mode) applies to queries already queued within this time.
POLICY_RECHECK_S = 0.1


class SwitchMode(LabelledChoice):
    """How an engine moves to a new epoch."""

    BESIDE = "beside", "prepare beside the current epoch, then switch (needs room for both)"
    STOP_THE_WORLD = "stop_the_world", (
        "stop the world: pause queries, free the current epoch, load the new one")


class EngineBusy(RuntimeError):
    """The engine cannot take this work now; the client should retry after `retry_after` seconds."""

    def __init__(self, reason: str, retry_after: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class EngineOverloaded(EngineBusy):
    """A lane's queue is full, or a query could not start within its deadline."""


class EngineUnavailable(EngineBusy):
    """The engine is stopped, switching, or its device failed."""


@dataclass(frozen=True)
class BatchAnswer:
    """Answers of one submitted request, all against one epoch.

    `answers` holds one 4096-byte row per key, in submission order (a view of the launch's
    answer buffer, which no later launch reuses); `pages[query][key]` slices it into bytes in the
    caller's thread, so the scheduler thread never copies answers while the device waits."""

    epoch_id: int
    answers: np.ndarray  # (keys, PAGE_BYTES) uint8
    query_keys: Tuple[int, ...]  # keys per query, in order
    state: ServedState  # the epoch and written rows every answer of the request comes from

    @property
    def pages(self) -> List[List[bytes]]:
        pages, row = [], 0
        for count in self.query_keys:
            pages.append([self.answers[row + i].tobytes() for i in range(count)])
            row += count
        return pages


@dataclass
class _Request:
    keys: KeyBatch
    query_keys: Tuple[int, ...]  # keys per query; their sum is len(keys)
    lane: str
    arrived: float
    future: Future = field(default_factory=Future)

    @property
    def size(self) -> int:
        return len(self.query_keys)


@dataclass
class _Flight:
    """A batch started on the device: what its answers are handed out with."""

    decision: Launch
    batch: List[_Request]
    epoch: ServedEpoch
    state: ServedState
    started_mono: float  # monotonic time it was started
    started: float  # perf_counter time it was started
    pending: Optional[PendingAnswer] = None

    @property
    def queries(self) -> int:
        return sum(r.size for r in self.batch)


class _FormatParts(PendingAnswer):
    """A batch started as one launch per key format; result() puts the answers back in order."""

    def __init__(self, key_counts: List[int], parts: List[Tuple[List[int], PendingAnswer]]) -> None:
        self._ends = np.cumsum(key_counts)
        self._parts = parts

    def result(self) -> np.ndarray:
        ends = self._ends
        answers = np.empty((int(ends[-1]), PAGE_BYTES), dtype=np.uint8)
        for members, pending in self._parts:
            part, row = pending.result(), 0
            for i in members:
                count = int(ends[i] - (ends[i - 1] if i else 0))
                answers[ends[i] - count:ends[i]] = part[row:row + count]
                row += count
        return answers


def settle(future: Future, result=None, error: Optional[BaseException] = None) -> None:
    """Resolve a future unless it is already done: a caller may cancel what it waits for."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def static_policy(policy: LanePolicy) -> PolicySource:
    return lambda lane: policy


def _fit_fields(fit) -> dict:
    return {"intercept_s": fit.intercept_s, "per_query_s": fit.per_query_s, "samples": fit.samples,
            "rmse_s": fit.rmse_s}


def key_formats_of(engine) -> Tuple[int, ...]:
    """The key formats `engine` answers (docs/PROTOCOL.md section 3): its key_formats (a
    QueryEngine's, gpu_engine.interface); v1 alone for an engine that names none. The web tier
    takes and advertises these."""
    return tuple(getattr(engine, "key_formats", (KEY_FORMAT_V1,)))


class Engine:
    """One per process and device; thread-safe. Views and tasks submit, never launch."""

    key_formats = (KEY_FORMAT_V1, KEY_FORMAT_V2)  # both, unless its backend answers one alone

    def __init__(self, backend: Backend, epoch: ServedEpoch,
                 policy: Optional[PolicySource] = None) -> None:
        self.backend = backend
        if tuple(backend.key_formats) != (KEY_FORMAT_V1, KEY_FORMAT_V2):  # a backend of one format
            self.key_formats = tuple(backend.key_formats)
        # the most queries a launch holds: what the backend serves in one pass over its matrix
        # (a policy's max_batch may ask for up to cuda_plan.MAX_LAUNCH_QUERIES; _applied cuts it)
        self.pass_queries: int = backend.pass_queries
        self._clamped: Dict[str, Tuple[LanePolicy, LanePolicy]] = {}  # lane -> (as given, as applied)
        # the scheduler, request threads, metrics scrapes and the server's replies all apply policies
        self._clamped_lock = threading.Lock()
        self._policy = policy or static_policy(LanePolicy())
        self._last_policies: Dict[str, LanePolicy] = {lane: self._applied(lane, LanePolicy())
                                                      for lane in LANES}
        self._epoch = epoch
        self._rows = RowDigest()  # rows written over the epoch's file since it was loaded
        self._resident: ResidentMatrix = load_placed(backend, epoch)
        self._queues: Dict[str, Deque[_Request]] = {lane: deque() for lane in LANES}
        self._depth: Dict[str, int] = {lane: 0 for lane in LANES}  # queries queued per lane
        self._queued_formats: Dict[int, int] = {}  # requests queued per key format (all lanes)
        self._rates: Dict[str, RateMeter] = {lane: RateMeter() for lane in LANES}
        self._last_launch_end: Dict[str, float] = {}  # lane -> monotonic end of its last launch
        # operations run between launches, each with the future its caller waits on
        self._control: Deque[Tuple[Callable[[], None], Future]] = deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self._inflight: List[_Request] = []  # dequeued, not yet answered
        # monotonic time the device last fell idle: a launch's hold is counted from the later of
        # this and its oldest query's arrival
        self._idle_since = time.monotonic()
        self._waited = False  # the scheduler chose to wait with queries queued since the last launch
        self._answered_at = 0.0  # perf_counter time the last batch's answers were handed out
        self.failure: Optional[str] = None  # why the scheduler died, if it did
        # why queries are refused while the engine runs on (hold()): it cannot serve the epoch
        # its party's database says is active, so it answers none rather than another epoch's
        self.held: Optional[str] = None
        self.cost = FormatCosts()  # launch costs per key format, measured
        self.stats = EngineStats(LANES)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Engine":
        with self._cond:
            if self._running:
                return self
            self._running = True
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()
        log.info("engine started: backend=%s epoch=%s pages=%s", self.backend.name,
                 self._epoch.epoch_id, self._epoch.matrix.num_pages)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._halt("engine stopped")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        _release(self._resident)

    def _halt(self, reason: str) -> None:
        """Stop taking work and fail everything queued or in flight with 503 and `reason`."""
        with self._cond:
            self._running = False
            pending = [r for q in self._queues.values() for r in q] + self._inflight
            control = [future for _, future in self._control]
            self._control.clear()
            for lane, q in self._queues.items():
                q.clear()
                self._depth[lane] = 0
            self._inflight = []
            self._cond.notify_all()
        for request in pending:
            if not request.future.done():
                self.stats.refuse(request.lane, "stopped", request.size)
            settle(request.future, error=EngineUnavailable(reason, retry_after=5))
        for future in control:  # row writes and epoch switches that never ran
            settle(future, error=EngineUnavailable(reason, retry_after=5))

    @property
    def running(self) -> bool:
        """True while the scheduler thread is alive and taking work."""
        return self._running and self._thread is not None and self._thread.is_alive()

    @property
    def epoch(self) -> ServedEpoch:
        return self._epoch

    def hold(self, reason: Optional[str]) -> None:
        """Refuse every query with 503 and `reason` from now on (None: take them again); the
        scheduler, epoch switches and row writes go on."""
        self.held = reason

    def set_policy_source(self, policy: PolicySource) -> None:
        """Read policies from `policy` from the next decision on (the live policy source)."""
        self._policy = policy
        self.poke()

    def poke(self) -> None:
        """Wake the scheduler to decide again now (a policy changed)."""
        with self._cond:
            self._cond.notify_all()

    def policies(self) -> Dict[str, LanePolicy]:
        """The policy of each lane now, as applied (_applied); a failing source keeps the last good one."""
        for lane in LANES:
            try:
                policy = self._policy(lane)
                if isinstance(policy, LanePolicy):
                    self._last_policies[lane] = self._applied(lane, policy)
                else:
                    log.error("policy source gave %r for lane %s; keeping the last one", policy, lane)
            except Exception:  # noqa: BLE001 - a broken source must not stop the scheduler
                log.exception("policy source failed for lane %s; keeping the last one", lane)
        return dict(self._last_policies)

    def _applied(self, lane: str, policy: LanePolicy) -> LanePolicy:
        """`policy` as this engine applies it: max_batch and adaptive_threshold at most the
        backend's pass_queries, so a launch holds no more than one pass over the matrix serves
        (and never less than a whole request; the records keep what the operator set; /health
        shows pass_queries). Every decision reads policies, so a policy cut once is kept while
        its source hands out the same one."""
        if max(policy.max_batch, policy.adaptive_threshold) <= self.pass_queries:
            return policy
        with self._clamped_lock:
            given, applied = self._clamped.get(lane, (None, None))
            if given is not policy:
                applied = replace(policy, max_batch=min(policy.max_batch, self.pass_queries),
                                  adaptive_threshold=min(policy.adaptive_threshold, self.pass_queries))
                self._clamped[lane] = (policy, applied)
            return applied

    # -- work ------------------------------------------------------------------------------
    def submit(self, queries: Sequence[Sequence[DpfKey]], lane: str = "interactive") -> "Future[BatchAnswer]":
        """Queue one request (a list of queries, each a list of keys); its answers share one epoch.

        Raises EngineOverloaded when the lane already holds its policy's max_queue queries."""
        if not queries or any(not q for q in queries):
            raise ValueError("a request needs at least one query, and each query at least one key")
        keys = KeyBatch.from_keys([key for query in queries for key in query])
        return self.submit_keys(keys, tuple(len(q) for q in queries), lane)

    def submit_keys(self, keys: KeyBatch, query_keys: Sequence[int],
                    lane: str = "interactive") -> "Future[BatchAnswer]":
        """`submit` for keys already packed and checked (the web tier's serializers, the engine
        server's socket): query i has query_keys[i]. The engine checks only their fit to the epoch
        it serves now, which may differ from the one they were checked against (a ValueError
        naming both); its resident matrix checks what reaches it as a batch starts."""
        if lane not in self._queues:
            raise ValueError(f"unknown lane {lane!r}, expected one of {', '.join(LANES)}")
        query_keys = tuple(query_keys)
        if not query_keys or min(query_keys) < 1 or sum(query_keys) != len(keys):
            raise ValueError(f"{len(keys)} keys do not split into queries of {list(query_keys)} keys")
        if keys.domain_bits != self._epoch.matrix.domain_bits:
            raise ValueError(f"keys have domain_bits {keys.domain_bits}, the epoch has "
                             f"{self._epoch.matrix.domain_bits}")
        if keys.key_format not in self.key_formats:
            raise ValueError(f"this engine answers {' and '.join(format_name(f) for f in self.key_formats)} "
                             f"keys only, got {format_name(keys.key_format)} keys")
        if self.held:
            self.stats.refuse(lane, "held", len(query_keys))
            raise EngineUnavailable(self.held, retry_after=5)
        policy = self._policy_for(lane)
        request = _Request(keys, query_keys, lane, time.monotonic())
        with self._cond:
            if not self._running:
                raise EngineUnavailable(self.failure or "engine is not running", retry_after=5)
            depth = self._depth[lane]
            if depth + request.size > policy.max_queue:
                refused = EngineOverloaded(
                    f"{lane} queue is full: {depth} queries queued, {request.size} more would pass "
                    f"the policy's max_queue of {policy.max_queue}", retry_after=self._drain_s(depth, policy))
            else:
                refused = None
                self._queues[lane].append(request)
                self._depth[lane] = depth + request.size
                fmt = keys.key_format
                self._queued_formats[fmt] = self._queued_formats.get(fmt, 0) + 1
                self._rates[lane].add(request.size, request.arrived)
                self._cond.notify()
        if refused is not None:
            self.stats.refuse(lane, "queue_full", request.size)
            raise refused
        return request.future

    def _policy_for(self, lane: str) -> LanePolicy:
        try:
            policy = self._policy(lane)
            if isinstance(policy, LanePolicy):
                return self._applied(lane, policy)
        except Exception:  # noqa: BLE001 - the scheduler logs it; admission uses the last good one
            pass
        return self._last_policies[lane]

    def launch_cap(self, lane: str) -> int:
        """The most queries a request on `lane` should carry: while a higher lane is active, a
        lane whose policy yields (yield_ms) launches no more than this, and a request is never
        split across launches (scheduler.launch_cap)."""
        return launch_cap(self._policy_for(lane), self.cost.fit())

    def _drain_s(self, depth: int, policy: LanePolicy) -> float:
        # How long the queue ahead takes to clear at full batches, as the Retry-After hint.
        fit = self.cost.fit()
        if not fit.samples:
            return 1.0
        return max(1.0, math.ceil(depth / policy.max_batch) * fit.predict(policy.max_batch))

    def answer(self, queries: Sequence[Sequence[DpfKey]], lane: str = "interactive",
               timeout: Optional[float] = None) -> BatchAnswer:
        return self.submit(queries, lane).result(timeout)

    def write_rows(self, rows: Mapping[int, bytes]) -> "Future[None]":
        """Overwrite rows between launches; the future resolves once answers include them."""
        rows = dict(rows)
        self._epoch.matrix.check_rows(rows)

        def write() -> None:
            self._resident.write_rows(rows)
            self._rows.write(rows)

        return self._run_between_launches(write)

    def switch_epoch(self, epoch: ServedEpoch, mode: SwitchMode = SwitchMode.BESIDE,
                     written: Optional[Mapping[int, bytes]] = None) -> "Future[None]":
        """Make `epoch` resident beside the current one, then swap between launches.

        written: rows already written over `epoch`'s matrix (pending updates it absorbs), which its
        state's digest counts. mode STOP_THE_WORLD: for a device that cannot hold both matrices,
        free the current one and load `epoch` on the scheduler thread; queries wait meanwhile. If
        that load fails, the current epoch is loaded again (without rows written since its load)
        and the future fails.
        """
        if SwitchMode(mode) is SwitchMode.STOP_THE_WORLD:
            return self._run_between_launches(lambda: self._reload(epoch, written))
        resident = load_placed(self.backend, epoch)

        def swap() -> None:
            old = self._resident
            self._epoch, self._resident, self._rows = epoch, resident, RowDigest(written)
            _release(old)
            log.info("epoch switched to %s", epoch.epoch_id)

        return self._run_between_launches(swap)

    def _reload(self, epoch: ServedEpoch, written: Optional[Mapping[int, bytes]]) -> None:
        check_placeable(self.backend, epoch)  # a placement that cannot be made frees nothing
        current = self._epoch
        _release(self._resident)
        try:
            self._resident = load_placed(self.backend, epoch)
        except Exception:
            self._resident = load_placed(self.backend, current)
            self._rows = RowDigest()
            raise
        self._epoch, self._rows = epoch, RowDigest(written)
        log.info("epoch switched to %s (stop the world)", epoch.epoch_id)

    @property
    def placement(self) -> str:
        """How the served epoch is placed now: "single" (one device), "shard" or "replicate"."""
        return describe_placement(self._resident)["placement"]

    @property
    def state(self) -> ServedState:
        """The state answers launched now come from (read between launches by the scheduler)."""
        return self._rows.state(self._epoch.epoch_id)

    def warm_up(self, max_batch: int = MAX_BATCH_QUERIES, seed: int = 0) -> "Future[None]":
        """Launch random keys of every batch size a lane may use before any query arrives.

        On a backend that compiles kernels or captures graphs per shape (CUDA), each size from 1 to
        `max_batch` queries runs once per lane's dispatch shape, then once more, timed, for the
        cost model, and full batches twice at once (the second set of buffers a batch started
        behind another one uses); elsewhere one small launch pages the matrix in. Each key format
        the engine answers (their own kernels and buffers) is warmed up and timed so, for its own
        cost model. Runs between launches. A max_batch above the backend's pass_queries warms up to
        pass_queries, the most a launch holds."""
        max_batch = min(max_batch, self.pass_queries)
        sizes = range(1, max_batch + 1) if self.backend.warm_all_shapes else (1,)

        def warm() -> None:
            started = time.perf_counter()
            rng = np.random.default_rng(seed)
            dispatches = {policy.dispatch for policy in self.policies().values()}
            for dispatch in dispatches:
                for queries in sizes:
                    # one batch of each format, answered on every replica's device, then timed
                    batches = [random_keys(queries * KEYS_PER_QUERY, self._epoch.matrix.domain_bits, rng, fmt)
                               for fmt in self.key_formats]
                    copies = self._resident.each_copy()
                    for fmt, batch in zip(self.key_formats, batches):
                        for copy in copies:
                            copy.answer(batch, dispatch)
                        timed = time.perf_counter()
                        self._resident.answer(batch, dispatch)
                        self.cost.observe((fmt,), queries, time.perf_counter() - timed)
                    for copy in copies:
                        if queries == max_batch:  # a full batch may start while another runs
                            for full in batches:
                                for pending in [copy.start(full, dispatch) for _ in range(2)]:
                                    pending.result()
            log.info("warm-up: %d batch sizes x %d dispatch shapes in %.1f s", len(sizes),
                     len(dispatches), time.perf_counter() - started)

        return self._run_between_launches(warm)

    def _run_between_launches(self, action: Callable[[], None]) -> "Future[None]":
        future: Future = Future()
        with self._cond:
            if not self._running:
                raise EngineUnavailable(self.failure or "engine is not running", retry_after=5)
            self._control.append((action, future))
            self._cond.notify()
        return future

    @staticmethod
    def _run_control(action: Callable[[], None], future: Future) -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            settle(future, error=exc)
        else:
            settle(future, None)

    # -- the scheduler loop: lock, decide, dequeue, run, sleep ------------------------------
    def _lane_queues(self, now: float) -> List[LaneQueue]:
        """What each lane holds now, as the scheduler decides from it (under the lock)."""
        return [LaneQueue(lane, tuple(r.size for r in itertools.islice(q, HEAD_REQUESTS)),
                          q[0].arrived if q else None, self._depth[lane], self._rates[lane].rate(now),
                          self._last_launch_end.get(lane), self._rates[lane].since_last(now))
                for lane, q in self._queues.items()]

    def _dequeue(self, lane: str, count: int) -> List[_Request]:
        queue = self._queues[lane]
        taken = [queue.popleft() for _ in range(count)]
        self._depth[lane] -= sum(r.size for r in taken)
        for request in taken:
            self._queued_formats[request.keys.key_format] -= 1
        return taken

    def _expire(self, policies: Mapping[str, LanePolicy], now: float) -> List[_Request]:
        expired: List[_Request] = []
        for lane, queue in self._queues.items():
            cutoff = expiry_cutoff(policies[lane], now)
            count = 0
            for request in queue:  # arrival order: the overdue ones are a prefix
                if request.arrived >= cutoff:
                    break
                count += 1
            expired += self._dequeue(lane, count)
        return expired

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a dead scheduler must not leave callers hanging
            log.exception("engine scheduler failed; the engine stops taking work")
            self.failure = f"engine scheduler failed: {exc!r}"
            self._halt(self.failure)

    def _loop(self) -> None:
        # the batches on the device(s), started and not yet answered, oldest first: at most the
        # resident's max_in_flight (two on one device, two per device of a replicated epoch)
        flights: Deque[_Flight] = deque()
        while True:
            batch: Optional[Tuple[Launch, List[_Request]]] = None
            expired: List[_Request] = []
            control: List[Tuple[Callable[[], None], Future]] = []
            with self._cond:
                while self._running and not self._control:
                    now = time.monotonic()
                    policies = self.policies()
                    expired = self._expire(policies, now)
                    if expired:
                        break
                    queues = self._lane_queues(now)
                    queued = [fmt for fmt, count in self._queued_formats.items() if count]
                    decision = decide(queues, policies, self.cost.fit(queued), now)
                    room = len(flights) < self._resident.max_in_flight
                    if isinstance(decision, Launch) and room and (
                            not flights or overlaps(decision, queues, policies)):
                        batch = (decision, self._dequeue(decision.lane, decision.requests))
                        # in flight from here on, under the lock: a _halt now fails them too
                        self._inflight = [r for f in flights for r in f.batch] + batch[1]
                        break
                    if flights:
                        break  # answer the oldest batch, then decide with its device free
                    wait = decision.seconds
                    self._waited = self._waited or any(self._depth.values())
                    self._cond.wait(POLICY_RECHECK_S if wait is None else min(wait, POLICY_RECHECK_S))
                if not self._running:
                    return
                if not flights:  # operations run with nothing on the device
                    control = list(self._control)
                    self._control.clear()
            for request in expired:
                timeout = self._last_policies[request.lane].queue_timeout_ms
                self.stats.refuse(request.lane, "deadline", request.size)
                settle(request.future, error=EngineOverloaded(
                    f"{request.lane} query not started within the policy's queue_timeout_ms of "
                    f"{timeout} ms", retry_after=1))
            for action, future in control:
                self._run_control(action, future)
            if batch:
                started = self._start(*batch)
                if started is not None:
                    flights.append(started)
            if flights and (batch is None or len(flights) >= self._resident.max_in_flight):
                self._finish(flights.popleft())
            self._inflight = [r for f in flights for r in f.batch]

    def _start(self, decision: Launch, batch: List[_Request]) -> Optional["_Flight"]:
        """Start `batch` on the device; None when it failed at once (its futures then failed)."""
        flight = _Flight(decision, batch, self._epoch, self.state, time.monotonic(),
                         time.perf_counter())
        try:
            flight.pending = self._start_keys(batch, decision.dispatch)
        except Exception as exc:  # noqa: BLE001 - a device failure fails this batch, not the engine
            self._failed(flight, exc)
            return None
        return flight

    def _failed(self, flight: "_Flight", exc: Exception) -> None:
        log.exception("launch of %d requests failed", len(flight.batch), exc_info=exc)
        self.stats.failure(flight.decision.lane, flight.queries)
        for request in flight.batch:
            settle(request.future, error=EngineUnavailable(f"device error: {exc}", retry_after=5))
        if isinstance(exc, DeviceFailed):
            # A device of a group is gone: the engine stops (an engine server exits, so that its
            # supervisor starts it again) rather than serve from the devices left.
            self.failure = str(exc)
            self._halt(self.failure)

    def _finish(self, flight: "_Flight") -> None:
        """Wait for the batch's answers and hand them out (a batch started behind it runs on)."""
        try:
            answers = flight.pending.result()
        except Exception as exc:  # noqa: BLE001 - a device failure fails this batch, not the engine
            self._failed(flight, exc)
            return
        # The device took the batch from when it started or the batch before it was answered,
        # whichever came later, to now.
        device_from = max(flight.started, self._answered_at)
        seconds = time.perf_counter() - device_from
        done = time.monotonic()
        decision, batch = flight.decision, flight.batch
        self._last_launch_end[decision.lane] = done
        # how long the device sat idle with this launch's oldest query waiting: what holding for
        # a fuller batch cost (near zero for a policy that launches at once)
        held = max(0.0, flight.started_mono - max(self._idle_since, batch[0].arrived))
        self._idle_since = done
        # Counted before any caller has its answer, so that what a caller reads from the
        # metrics after its answer already holds the launch that made it.
        self.stats.launched(decision, seconds, [(r.size, flight.started_mono - r.arrived, done - r.arrived)
                                                for r in batch], done, held, self._waited)
        row = 0
        for request in batch:
            count = len(request.keys)
            settle(request.future, BatchAnswer(flight.epoch.epoch_id, answers[row:row + count],
                                               request.query_keys, flight.state))
            row += count
        # The cost model plans with how long a launch keeps the scheduler from the next one:
        # the device time and handing the answers out (futures' callbacks run here).
        self._answered_at = time.perf_counter()
        self.cost.observe({r.keys.key_format for r in batch}, flight.queries, self._answered_at - device_from)
        self._waited = False

    def _start_keys(self, batch: List[_Request], dispatch) -> PendingAnswer:
        """Start every request's keys: one launch per key format in the batch (a launch holds
        keys of one format; v1 and v2 requests queue together)."""
        formats = sorted({r.keys.key_format for r in batch})
        if len(formats) == 1:
            keys = batch[0].keys if len(batch) == 1 else _concat([r.keys for r in batch])
            return self._resident.start(keys, dispatch)
        members = [[i for i, r in enumerate(batch) if r.keys.key_format == fmt] for fmt in formats]
        started = self._resident.start_parts(
            [_concat([batch[i].keys for i in group]) for group in members], dispatch)
        return _FormatParts([len(r.keys) for r in batch], list(zip(members, started)))

    # -- what operators and metrics read --------------------------------------------------
    def health(self) -> dict:
        with self._cond:
            depth = dict(self._depth)
        placed = describe_placement(self._resident)
        return {
            # a failed device of a group stops this party answering (503 with its reason)
            "running": self.running and not placed.get("failure") and not self.held,
            "held": self.held,
            "failure": self.failure or placed.get("failure") or self.held,
            "placement": placed,
            "epoch_id": self._epoch.epoch_id,
            "state": self.state.describe(),
            "queue_depth": depth,
            "resident_bytes": self._resident.nbytes,
            **self.backend.describe(),
        }

    def snapshot(self) -> dict:
        """Everything the metrics and the admin show, as plain data (no locks held by the caller)."""
        now = time.monotonic()
        with self._cond:
            depth = dict(self._depth)
            rates = {lane: meter.rate(now) for lane, meter in self._rates.items()}
        policies = dict(self._last_policies)
        fit = self.cost.fit()
        data = self.stats.snapshot(now)
        data.update(running=self.running, epoch_id=self._epoch.epoch_id, backend=self.backend.name,
                    pass_queries=self.pass_queries, layout=self.backend.layout,
                    layout_reason=self.backend.layout_reason,
                    placement=describe_placement(self._resident),
                    cost=_fit_fields(fit),  # the dearest format's: what admission and the dashboard plan with
                    cost_by_format={format_name(fmt): _fit_fields(each) for fmt, each in self.cost.by_format().items()})
        for lane in LANES:
            policy = policies[lane]
            info = data["lanes"][lane]
            info.update(queued=depth[lane], arrival_rate=rates[lane], policy=policy.name, mode=policy.mode)
            if policy.mode == "slo" and fit.samples:
                plan = plan_slo(policy, fit, rates[lane])
                info["slo_plan"] = {"batch": plan.batch, "window_s": plan.window_s,
                                    "budget_s": plan.budget_s, "feasible": plan.feasible}
        return data


def _release(resident: ResidentMatrix) -> None:
    """Free a resident matrix the engine no longer serves from; a failure to (a lost GPU) is
    logged, never raised into the switch or stop that let go of it."""
    try:
        resident.release()
    except Exception:  # noqa: BLE001 - what is served now does not depend on it
        log.exception("releasing an epoch's device memory failed")


def _concat(batches: Sequence[KeyBatch]) -> KeyBatch:
    """One batch of the keys of `batches`, all of one key format."""
    return KeyBatch(
        domain_bits=batches[0].domain_bits,
        key_format=batches[0].key_format,
        root_seed=np.concatenate([b.root_seed for b in batches]),
        root_t=np.concatenate([b.root_t for b in batches]),
        cw_seed=np.concatenate([b.cw_seed for b in batches]),
        cw_t=np.concatenate([b.cw_t for b in batches]),
        final_cw=np.concatenate([b.final_cw for b in batches]),
    )

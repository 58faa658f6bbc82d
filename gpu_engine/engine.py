"""The Engine: owns one device, coalesces submitted queries into launches on a scheduler thread."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence

import numpy as np

from gpu_engine.backends.base import Backend, DispatchShape, ResidentMatrix
from gpu_engine.dpf import DpfKey, KeyBatch
from gpu_engine.matrix import Epoch
from gpu_engine.scheduler import LANES, BatchingPolicy, Launch, LaneQueue, decide

log = logging.getLogger(__name__)

PolicySource = Callable[[str], BatchingPolicy]  # lane -> the policy in force now


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


@dataclass
class BatchAnswer:
    """Answers of one submitted request, all against one epoch: pages[query][key] is 4096 bytes."""

    epoch_id: int
    pages: List[List[bytes]]


@dataclass
class _Request:
    queries: Sequence[Sequence[DpfKey]]
    keys: KeyBatch
    lane: str
    arrived: float
    future: Future = field(default_factory=Future)

    @property
    def size(self) -> int:
        return len(self.queries)


@dataclass
class EngineStats:
    """Counters since start; read without the lock (each field is updated atomically)."""

    launches: int = 0
    queries_answered: int = 0
    requests_answered: int = 0
    failures: int = 0
    last_batch_queries: int = 0
    compute_seconds: float = 0.0


def static_policy(policy: BatchingPolicy) -> PolicySource:
    return lambda lane: policy


class Engine:
    """One per process and device; thread-safe. Views and tasks submit, never launch."""

    def __init__(
        self,
        backend: Backend,
        epoch: Epoch,
        policy: Optional[PolicySource] = None,
        dispatch: DispatchShape = DispatchShape(),
    ) -> None:
        self.backend = backend
        self._policy = policy or static_policy(BatchingPolicy())
        self._dispatch = dispatch
        self._epoch = epoch
        self._resident: ResidentMatrix = backend.load(epoch.matrix)
        self._queues: Dict[str, Deque[_Request]] = {lane: deque() for lane in LANES}
        self._control: Deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self.stats = EngineStats()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Engine":
        with self._cond:
            if self._running:
                return self
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()
        log.info("engine started: backend=%s epoch=%s pages=%s", self.backend.name,
                 self._epoch.epoch_id, self._epoch.matrix.num_pages)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._running = False
            pending = [r for q in self._queues.values() for r in q]
            for q in self._queues.values():
                q.clear()
            self._cond.notify_all()
        for request in pending:
            request.future.set_exception(EngineUnavailable("engine stopped", retry_after=5))
        if self._thread is not None:
            self._thread.join(timeout)
        self._resident.release()

    @property
    def epoch(self) -> Epoch:
        return self._epoch

    # -- work ------------------------------------------------------------------------------
    def submit(self, queries: Sequence[Sequence[DpfKey]], lane: str = "interactive") -> "Future[BatchAnswer]":
        """Queue one request (a list of queries, each a list of keys); its answers share one epoch."""
        if lane not in self._queues:
            raise ValueError(f"unknown lane {lane!r}, expected one of {', '.join(LANES)}")
        if not queries or any(not q for q in queries):
            raise ValueError("a request needs at least one query, and each query at least one key")
        keys = KeyBatch.from_keys([key for query in queries for key in query])
        if keys.domain_bits != self._epoch.matrix.domain_bits:
            raise ValueError(f"keys have domain_bits {keys.domain_bits}, the epoch has "
                             f"{self._epoch.matrix.domain_bits}")
        request = _Request(queries, keys, lane, time.monotonic())
        with self._cond:
            if not self._running:
                raise EngineUnavailable("engine is not running", retry_after=5)
            self._queues[lane].append(request)
            self._cond.notify()
        return request.future

    def answer(self, queries: Sequence[Sequence[DpfKey]], lane: str = "interactive",
               timeout: Optional[float] = None) -> BatchAnswer:
        return self.submit(queries, lane).result(timeout)

    def write_rows(self, rows: Mapping[int, bytes]) -> "Future[None]":
        """Overwrite rows between launches; the future resolves once answers include them."""
        for index, data in rows.items():
            self._epoch.matrix.check_row(index, data)
        return self._run_between_launches(lambda: self._resident.write_rows(dict(rows)))

    def switch_epoch(self, epoch: Epoch) -> "Future[None]":
        """Make `epoch` resident beside the current one, then swap between launches."""
        resident = self.backend.load(epoch.matrix)

        def swap() -> None:
            old = self._resident
            self._epoch, self._resident = epoch, resident
            old.release()
            log.info("epoch switched to %s", epoch.epoch_id)

        return self._run_between_launches(swap)

    def _run_between_launches(self, action: Callable[[], None]) -> "Future[None]":
        future: Future = Future()

        def run() -> None:
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)
            else:
                future.set_result(None)

        with self._cond:
            if not self._running:
                raise EngineUnavailable("engine is not running", retry_after=5)
            self._control.append(run)
            self._cond.notify()
        return future

    # -- the scheduler loop: lock, decide, dequeue, run, repeat ---------------------------
    def _snapshot(self) -> List[LaneQueue]:
        return [LaneQueue(lane, tuple(r.size for r in q), q[0].arrived if q else None)
                for lane, q in self._queues.items()]

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._control:
                    decision = decide(self._snapshot(), {l: self._policy(l) for l in LANES}, time.monotonic())
                    if isinstance(decision, Launch):
                        queue = self._queues[decision.lane]
                        batch = [queue.popleft() for _ in range(decision.requests)]
                        break
                    self._cond.wait(decision.seconds)
                else:
                    batch = None
                if not self._running:
                    return
                control = list(self._control)
                self._control.clear()
            for action in control:
                action()
            if batch:
                self._launch(batch)

    def _launch(self, batch: List[_Request]) -> None:
        epoch = self._epoch
        keys = batch[0].keys if len(batch) == 1 else _concat([r.keys for r in batch])
        started = time.perf_counter()
        try:
            answers = self._resident.answer(keys, self._dispatch)
        except Exception as exc:  # noqa: BLE001 - a device failure fails this batch, not the engine
            log.exception("launch of %d requests failed", len(batch))
            self.stats.failures += 1
            for request in batch:
                request.future.set_exception(EngineUnavailable(f"device error: {exc}", retry_after=5))
            return
        self.stats.compute_seconds += time.perf_counter() - started
        self.stats.launches += 1
        self.stats.last_batch_queries = sum(r.size for r in batch)
        row = 0
        for request in batch:
            pages = []
            for query in request.queries:
                pages.append([answers[row + i].tobytes() for i in range(len(query))])
                row += len(query)
            request.future.set_result(BatchAnswer(epoch.epoch_id, pages))
            self.stats.requests_answered += 1
            self.stats.queries_answered += request.size

    def health(self) -> dict:
        with self._cond:
            depth = {lane: sum(r.size for r in q) for lane, q in self._queues.items()}
        return {
            "running": self._running,
            "epoch_id": self._epoch.epoch_id,
            "queue_depth": depth,
            "resident_bytes": self._resident.nbytes,
            **self.backend.describe(),
        }


def _concat(batches: Sequence[KeyBatch]) -> KeyBatch:
    return KeyBatch(
        domain_bits=batches[0].domain_bits,
        root_seed=np.concatenate([b.root_seed for b in batches]),
        root_t=np.concatenate([b.root_t for b in batches]),
        cw_seed=np.concatenate([b.cw_seed for b in batches]),
        cw_t=np.concatenate([b.cw_t for b in batches]),
        final_cw=np.concatenate([b.final_cw for b in batches]),
    )

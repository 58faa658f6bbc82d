"""RemoteEngine: the Engine's interface in a process whose engine runs in an engine server.

Web and Celery processes submit queries on a lane and get futures, read the epoch and the
policies, and ask for health and metrics, exactly as with an in-process Engine. One I/O thread
per process owns the DEALER socket; request threads hand it frames through a queue. The server's
PONGs (every PING_S) keep the epoch and policies current. A server that dies is noticed at once
(the socket's disconnect event) and one that stops answering within `deadline_s`: either way the
requests in flight fail with EngineUnavailable (503) instead of waiting, and new ones are refused
until the server answers again; ZeroMQ reconnects by itself when it is back.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from gpu_engine import wire
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, DpfKey, KeyBatch, key_format_of
from gpu_engine.engine import BatchAnswer, EngineOverloaded, EngineUnavailable, settle
from gpu_engine.matrix import ServedEpoch, epoch_from_description
from morpho_pir.protocol import MAX_BATCH_QUERIES, PAGE_BYTES
from gpu_engine.scheduler import LanePolicy
from morpho_pir.state import ServedState

log = logging.getLogger(__name__)

PING_S = 0.25  # seconds between pings: how stale a client's epoch and policies may be
CONNECT_WAIT_S = 2.0  # how long the first use waits for the server's first answer
RECONNECT_MS = 100  # ZeroMQ's reconnect interval after the server went away (ms)


class RemoteError(RuntimeError):
    """A control operation failed inside the engine server; the message is the server's."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class RemoteEngine:
    """A thread-safe client of one engine server; one per process (create it after a fork)."""

    def __init__(self, url: str, deadline_s: float = 5.0, context: Optional[zmq.Context] = None) -> None:
        self.url = url
        self.deadline_s = deadline_s
        self.backend_name = "remote"
        # the key formats the engine server answers (its PONGs say; QUERY keys are sized by their
        # format): both until it has answered
        self.key_formats = (KEY_FORMAT_V1, KEY_FORMAT_V2)
        self._context = context or zmq.Context()
        self._ids = itertools.count(1)
        self._pending: Dict[int, Tuple[Future, Optional[Tuple[int, ...]]]] = {}
        # QUERY messages sent and not yet answered: message id -> the requests it carries, in order
        self._merged: Dict[int, List[int]] = {}
        self._lock = threading.Lock()
        self._outbox: Deque[Any] = deque()  # frame lists (control, ping) and _Query entries
        self._waker = wire.Waker(self._context, f"inproc://remote-engine-wake-{id(self)}")
        self._status: Optional[dict] = None  # the last PONG's body
        self._epoch: Optional[ServedEpoch] = None
        self._policies: Dict[str, LanePolicy] = {}
        self._connected = False
        self._last_heard = 0.0  # monotonic time of the last message from the server
        self._down_reason: Optional[str] = f"engine server {url} has not answered yet"
        self._heard = threading.Event()
        self._stop = threading.Event()
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="remote-engine-io", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(10)

    # -- what callers use (the Engine's interface) ------------------------------------------
    def wait_connected(self, timeout: float = CONNECT_WAIT_S) -> bool:
        return self._heard.wait(timeout)

    @property
    def running(self) -> bool:
        status = self._status
        return (self._down_reason is None and status is not None and status["running"]
                and not status["warming"])

    @property
    def held(self) -> Optional[str]:
        """Why the engine server refuses every query while it runs on (Engine.hold), else None."""
        return (self._status or {}).get("held")

    @property
    def failure(self) -> Optional[str]:
        if self._down_reason is not None:
            return self._down_reason
        status = self._status or {}
        if status.get("warming"):
            return "the engine server is warming up"
        return status.get("failure")

    @property
    def epoch(self) -> ServedEpoch:
        self._check_up()
        assert self._epoch is not None
        return self._epoch

    @property
    def state(self) -> ServedState:
        """The engine server's state as of its last PONG (answers carry their own)."""
        self._check_up()
        return ServedState.from_description(self._status["state"])

    def policies(self) -> Dict[str, LanePolicy]:
        self._check_up()
        return dict(self._policies)

    def launch_cap(self, lane: str) -> int:
        """The engine server's Engine.launch_cap as of its last PONG."""
        self._check_up()
        return self._status["launch_caps"][lane]  # every PONG carries them (EngineServer.status)

    def submit(self, queries: Sequence[Sequence[DpfKey]], lane: str = "interactive") -> "Future[BatchAnswer]":
        """Queue queries of equal key counts on `lane`; the future holds their answers."""
        if not queries or any(not q for q in queries):
            raise ValueError("a request needs at least one query, and each query at least one key")
        per_query = len(queries[0])
        if any(len(q) != per_query for q in queries):
            raise ValueError("every query of one request must carry the same number of keys")
        raw = b"".join(key.to_bytes() for query in queries for key in query)
        return self._submit_raw(raw, queries[0][0].domain_bits, per_query, len(queries), lane)

    def submit_keys(self, keys: KeyBatch, query_keys: Sequence[int],
                    lane: str = "interactive") -> "Future[BatchAnswer]":
        per_query = query_keys[0]
        if any(count != per_query for count in query_keys) or per_query * len(query_keys) != len(keys):
            raise ValueError(f"{len(keys)} keys do not split into equal queries of {list(query_keys)}")
        return self._submit_raw(keys.to_bytes(), keys.domain_bits, per_query, len(query_keys), lane)

    def answer(self, queries, lane: str = "interactive", timeout: Optional[float] = None) -> BatchAnswer:
        return self.submit(queries, lane).result(timeout)

    def health(self) -> dict:
        """The engine server's health, plus whether it is reachable from here."""
        try:
            data = self.call("health", timeout=min(self.deadline_s, 2.0))
        except (EngineUnavailable, RemoteError) as exc:
            return {"running": False, "reachable": False, "failure": str(exc), "engine_url": self.url,
                    "backend": "unknown", "queue_depth": {}}
        data["reachable"] = True
        return data

    def snapshot(self) -> dict:
        return self.call("snapshot", timeout=min(self.deadline_s, 2.0))

    def call(self, op: str, timeout: Optional[float] = None, **args: Any) -> Any:
        """Run a control operation in the engine server and wait for its result."""
        self._check_up()
        future = self._send([wire.CONTROL, None, wire.dumps({"op": op, "args": args})], None)
        try:
            reply = future.result(timeout if timeout is not None else self.deadline_s)
        except TimeoutError:
            raise EngineUnavailable(f"engine server {self.url} did not answer {op!r} within "
                                    f"{timeout} s", retry_after=5) from None
        if "error" in reply:
            raise RemoteError(reply["error"], reply.get("kind", ""))
        return reply["result"]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._fail_all("engine client stopped")

    # -- internals --------------------------------------------------------------------------
    def _check_up(self) -> None:
        """Raise EngineUnavailable while the server is down. A warming server is asked all the
        same: it refuses queries itself until it is ready, and the last PONG may be up to
        PING_S older than its readiness (a query refused on it would be a needless 503)."""
        if self._status is None and self._down_reason is not None:
            self._heard.wait(CONNECT_WAIT_S)  # a fresh process: give the first PONG a moment
        if self._down_reason is not None:
            raise EngineUnavailable(self._down_reason, retry_after=2)

    def _submit_raw(self, raw: bytes, domain_bits: int, per_query: int, queries: int,
                    lane: str) -> "Future[BatchAnswer]":
        # The keys are not checked here: the web tier checked them, and the engine server checks
        # what arrives on its socket and its Engine their fit to the epoch it serves; a refusal
        # comes back as the future's ValueError.
        self._check_up()
        wire.lane_index(lane)  # an unknown lane is the caller's error, raised here
        return self._send(_Query(0, lane, domain_bits, per_query, queries, raw),
                          (per_query,) * queries)

    def _send(self, item, query_keys: Optional[Tuple[int, ...]]) -> Future:
        """Queue `item` (a frame list whose [1] is the request id, or a _Query) for the I/O thread."""
        future: Future = Future()
        rid = next(self._ids)
        if isinstance(item, _Query):
            item.rid = rid
        else:
            item[1] = wire.pack_id(rid)
        with self._lock:
            self._pending[rid] = (future, query_keys)
            self._outbox.append(item)
        self._waker.wake()
        return future

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
            self._merged.clear()
            self._outbox.clear()
        for future, _ in pending:
            settle(future, error=EngineUnavailable(reason, retry_after=2))

    def _mark_down(self, reason: str) -> None:
        if self._down_reason is None:
            log.warning("engine server unavailable: %s", reason)
        self._down_reason = reason
        self._heard.clear()
        self._fail_all(reason)

    def _run(self) -> None:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a server that is not there
        dealer.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        dealer.setsockopt(zmq.SNDHWM, 100_000)
        dealer.setsockopt(zmq.RCVHWM, 100_000)
        monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        wake = self._waker.bind()
        dealer.connect(self.url)
        poller = zmq.Poller()
        for sock in (dealer, monitor, wake):
            poller.register(sock, zmq.POLLIN)
        self._ready.set()
        last_ping = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_ping >= PING_S and self._connected:
                    self._send_now(dealer, [wire.PING, wire.pack_id(0)])
                    last_ping = now
                timeout_ms = max(1, int((last_ping + PING_S - now) * 1000))
                events = dict(poller.poll(timeout_ms))
                if monitor in events:
                    self._on_monitor(monitor, dealer)
                    last_ping = 0.0 if self._connected else last_ping
                if wake in events:
                    self._waker.woken(wake)
                self._flush(dealer)
                if dealer in events:
                    for _ in range(256):
                        if not wire.readable(dealer):
                            break
                        self._on_reply(dealer.recv_multipart(copy=False))
                self._check_deadline()
        finally:
            dealer.disable_monitor()
            for sock in (monitor, dealer, wake):
                sock.close(0)
            self._waker.close()

    def _flush(self, dealer: zmq.Socket) -> None:
        """Send everything queued. Queries that arrived together on one lane, in one key format,
        travel as one QUERY message (up to 32 queries, what one request may hold, and no more
        than the lane's launch cap): the engine server then
        parses, queues and answers them once, and its per-message cost is paid once per group,
        not per request."""
        groups: Dict[tuple, List[_Query]] = {}
        while True:
            try:
                item = self._outbox.popleft()
            except IndexError:
                break
            if not isinstance(item, _Query):
                if not self._send_now(dealer, item):
                    self._resolve_error([wire.unpack_id(item[1])], "engine server is not connected")
                continue
            shape = (item.lane, item.domain_bits, item.per_query, key_format_of(item.raw))
            group = groups.setdefault(shape, [])
            if group and sum(q.queries for q in group) + item.queries > self._merge_cap(item.lane):
                self._send_queries(dealer, group)
                group = groups[shape] = []
            group.append(item)
        for group in groups.values():
            if group:
                self._send_queries(dealer, group)

    def _merge_cap(self, lane: str) -> int:
        # The engine never splits a request, so a merged one must still fit the lane's launch
        # cap: a bulk launch cut short for interactive queries could not be cut otherwise.
        status = self._status or {}
        return min(MAX_BATCH_QUERIES, status.get("launch_caps", {}).get(lane, MAX_BATCH_QUERIES))

    def _send_queries(self, dealer: zmq.Socket, group: "List[_Query]") -> None:
        first = group[0]
        queries = sum(q.queries for q in group)
        rids = [q.rid for q in group]
        raw = first.raw if len(group) == 1 else b"".join(q.raw for q in group)
        header = wire.pack_query(first.lane, first.domain_bits, first.per_query, queries)
        with self._lock:
            self._merged[first.rid] = rids
        if not self._send_now(dealer, [wire.QUERY, wire.pack_id(first.rid), header, raw]):
            with self._lock:
                self._merged.pop(first.rid, None)
            self._resolve_error(rids, "engine server is not connected")

    @staticmethod
    def _send_now(dealer: zmq.Socket, frames: List[Any]) -> bool:
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _resolve_error(self, rids: Sequence[int], reason: str) -> None:
        with self._lock:
            entries = [self._pending.pop(rid, None) for rid in rids]
        for entry in entries:
            if entry is not None:
                settle(entry[0], error=EngineUnavailable(reason, retry_after=2))

    def _on_monitor(self, monitor: zmq.Socket, dealer: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected = True
                self._last_heard = time.monotonic()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._mark_down(f"engine server {self.url} went away (connection lost)")

    def _check_deadline(self) -> None:
        # A server that stopped answering (SIGSTOP, a hung host) keeps its socket open: only
        # silence past the deadline shows it. PINGs every PING_S keep a live server talking.
        if self._down_reason is None and time.monotonic() - self._last_heard > self.deadline_s:
            self._mark_down(f"engine server {self.url} did not answer for {self.deadline_s:g} s")

    def _on_reply(self, frames) -> None:
        self._last_heard = time.monotonic()
        kind = frames[0].bytes
        if kind == wire.PONG:
            status = wire.loads(frames[2].bytes)
            if self._status is None or status["epoch"] != self._status["epoch"]:
                self._epoch = epoch_from_description(status["epoch"])
            self._policies = wire.policies_from_json(status["policies"])
            self.key_formats = tuple(status.get("key_formats", self.key_formats))
            if self._down_reason is not None:
                if self._status is None:
                    log.info("connected to engine server %s", self.url)
                else:
                    log.info("engine server %s answers again (%s)", self.url, self._down_reason)
            self._status = status
            self._down_reason = None
            self._heard.set()
            return
        rid = wire.unpack_id(frames[1].bytes)
        with self._lock:
            # a QUERY message answers every request merged into it, in the order they were sent
            rids = self._merged.pop(rid, None) or [rid]
            entries = [self._pending.pop(r, None) for r in rids]
        if kind == wire.ANSWER:
            answers = frames[3].buffer
            state, keys = wire.unpack_answer(frames[2].bytes, len(answers))
            array = np.frombuffer(answers, dtype=np.uint8).reshape(keys, PAGE_BYTES)
            row = 0
            for entry in entries:
                if entry is None:
                    continue  # failed already (deadline, disconnect): the late answer is dropped
                future, query_keys = entry
                count = sum(query_keys)
                settle(future, BatchAnswer(state.epoch_id, array[row:row + count], query_keys, state))
                row += count
            return
        for entry in entries:
            if entry is None:
                continue
            future = entry[0]
            if kind == wire.RESULT:
                settle(future, wire.loads(frames[2].bytes))
            elif kind == wire.ERROR:
                settle(future, error=_error(wire.loads(frames[2].bytes)))
            else:
                settle(future, error=EngineUnavailable(f"engine server sent message kind {kind!r}"))


class _Query:
    """One submitted request waiting in the outbox for the I/O thread to send (perhaps merged)."""

    __slots__ = ("rid", "lane", "domain_bits", "per_query", "queries", "raw")

    def __init__(self, rid: int, lane: str, domain_bits: int, per_query: int, queries: int,
                 raw: bytes) -> None:
        self.rid, self.lane, self.domain_bits = rid, lane, domain_bits
        self.per_query, self.queries, self.raw = per_query, queries, raw


def _error(body: dict) -> Exception:
    if body["kind"] == wire.OVERLOADED:
        return EngineOverloaded(body["reason"], retry_after=body["retry_after"])
    if body["kind"] == wire.INVALID:
        return ValueError(body["reason"])
    return EngineUnavailable(body["reason"], retry_after=body["retry_after"])

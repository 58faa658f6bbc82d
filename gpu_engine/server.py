"""The engine server: one process owns the device and its Engine; clients reach it over ZeroMQ.

One I/O thread owns the ROUTER socket. It parses QUERY messages into key batches and submits them
to the engine; the engine's scheduler thread resolves the futures, whose callbacks queue the
answer frames for the I/O thread (ZeroMQ sockets belong to one thread). CONTROL messages run on a
small thread pool, since some (an epoch switch) take seconds. PINGs are answered at once with the
server's status, which is how clients learn the epoch and policies and notice a dead server.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

import zmq

from gpu_engine import wire
from morpho_pir.dpf import KeyBatch, KeyFormatError, key_length_from_bytes
from gpu_engine.engine import BatchAnswer, Engine, EngineBusy, EngineOverloaded
from gpu_engine.scheduler import LANES

log = logging.getLogger(__name__)

ControlFn = Callable[[Dict[str, Any]], Any]  # args -> JSON-able result; raises to report an error
POLL_MS = 100  # the I/O thread looks at its stop flag at least this often (ms)
CONTROL_THREADS = 4  # control operations that may run at once (epoch switches, health, metrics)
HIGH_WATER = 100_000  # messages queued per peer before ZeroMQ drops (ROUTER) or blocks
SNAPSHOT_TTL_S = 0.5  # how long one engine snapshot answers every client's "snapshot" (s)


class EngineServer:
    """Serves `engine` on `url` (ipc://path or tcp://host:port) until stop()."""

    def __init__(self, engine: Engine, url: str, controls: Optional[Mapping[str, ControlFn]] = None,
                 context: Optional[zmq.Context] = None) -> None:
        self.engine = engine
        self.url = url
        self.controls: Dict[str, ControlFn] = dict(controls or {})
        self.controls.setdefault("health", lambda args: self.health())
        self.controls.setdefault("snapshot", lambda args: self._cached_snapshot())
        self._snapshot_cache: Tuple[float, Optional[dict]] = (0.0, None)  # (monotonic time, data)
        self._snapshot_lock = threading.Lock()
        self._context = context or zmq.Context.instance()
        self._outbox: Deque[List[Any]] = deque()  # frames for the I/O thread to send
        self._waker = wire.Waker(self._context, f"inproc://engine-server-wake-{id(self)}")
        self._pool = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="engine-control")
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.warming = True  # queries are refused (503) until mark_ready()
        self.warm_seconds: Optional[float] = None
        self._started = time.monotonic()
        self.clients_seen: set = set()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "EngineServer":
        """Bind and serve on a thread of this process; returns once the socket is bound."""
        self._thread = threading.Thread(target=self._serve, name="engine-server-io", daemon=True)
        self._thread.start()
        if not self._bound.wait(30):
            raise RuntimeError(f"engine server did not bind {self.url}")
        if self._stop.is_set():
            raise RuntimeError(f"engine server could not bind {self.url}")
        return self

    def mark_ready(self) -> None:
        """Warm-up is over: take queries from now on."""
        self.warm_seconds = time.monotonic() - self._started
        self.warming = False
        log.info("engine server ready on %s (%.1f s after start)", self.url, self.warm_seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def wait(self) -> None:
        """Block until the I/O thread ends (stop() from another thread or a signal handler)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def health(self) -> dict:
        data = self.engine.health()
        data.update(warming=self.warming, warm_seconds=self.warm_seconds, engine_url=self.url,
                    engine_clients=len(self.clients_seen))
        return data

    def _cached_snapshot(self) -> dict:
        """The engine's snapshot, computed at most once per SNAPSHOT_TTL_S: every web process
        samples it each second for its dashboard history and each scrape of /metrics asks again,
        and each computation costs the scheduler's interpreter time."""
        with self._snapshot_lock:
            taken, data = self._snapshot_cache
            if data is None or time.monotonic() - taken >= SNAPSHOT_TTL_S:
                data = self.engine.snapshot()
                self._snapshot_cache = (time.monotonic(), data)
            return data

    def status(self) -> dict:
        """What every PONG carries: enough for a client to validate keys and pick batch sizes."""
        engine = self.engine
        return {"epoch": engine.epoch.describe(), "state": engine.state.describe(),
                "running": engine.running, "held": engine.held,
                "failure": engine.failure, "warming": self.warming,
                "policies": wire.policies_to_json(engine.policies()),
                "launch_caps": {lane: engine.launch_cap(lane) for lane in LANES},
                "key_formats": list(engine.key_formats)}

    # -- replies from other threads ---------------------------------------------------------
    def _post(self, frames: List[Any]) -> None:
        self._outbox.append(frames)
        self._waker.wake()

    def _answered(self, peer: bytes, rid: bytes, future: "Future[BatchAnswer]") -> None:
        try:
            result = future.result()
        except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the client
            self._post([peer, wire.ERROR, rid, _error_body(exc)])
            return
        self._post([peer, wire.ANSWER, rid, wire.pack_answer(result.state, len(result.answers)),
                    memoryview(result.answers).cast("B")])

    def _control(self, peer: bytes, rid: bytes, body) -> None:
        try:
            message = wire.loads(body)
            op = message.get("op")
            handler = self.controls.get(op)
            if handler is None:
                raise KeyError(f"unknown control operation {op!r}; known: {sorted(self.controls)}")
            reply = {"result": handler(message.get("args") or {})}
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, who raises it
            reply = {"error": str(exc), "kind": type(exc).__name__}
        self._post([peer, wire.RESULT, rid, wire.dumps(reply)])

    # -- the I/O thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, HIGH_WATER)
        router.setsockopt(zmq.RCVHWM, HIGH_WATER)
        router.setsockopt(zmq.LINGER, 0)
        wake = self._waker.bind()
        try:
            router.bind(self.url)
        except zmq.ZMQError as exc:
            log.error("engine server cannot bind %s: %s", self.url, exc)
            self._stop.set()
            self._bound.set()
            wake.close(0)
            router.close(0)
            return
        ipc = self.url[len("ipc://"):] if self.url.startswith("ipc://") else None
        if ipc:
            # ZeroMQ makes the socket under the process's umask (0755 by the usual 022, 0777
            # under 0): only this user and its group may submit queries or control operations.
            os.chmod(ipc, 0o660)
            made = os.stat(ipc).st_ino
        self._bound.set()
        log.info("engine server listening on %s", self.url)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                if wake in events:
                    self._waker.woken(wake)
                while self._outbox:
                    router.send_multipart(self._outbox.popleft(), copy=False)
                if router in events:
                    for _ in range(256):  # then send what queued meanwhile
                        if not wire.readable(router):
                            break
                        self._handle(router, router.recv_multipart())
        finally:
            router.close(0)
            wake.close(0)
            self._waker.close()
            if ipc:
                _remove_socket(ipc, made)

    def _handle(self, router: zmq.Socket, frames: List[bytes]) -> None:
        if len(frames) < 3:
            log.warning("engine server: dropped a message of %d frames", len(frames))
            return
        peer, kind, rid = frames[0], frames[1], frames[2]
        self.clients_seen.add(peer)
        if kind == wire.QUERY and len(frames) == 5:
            reply = self._query(peer, rid, frames[3], frames[4])
            if reply is not None:
                router.send_multipart([peer, wire.ERROR, rid, reply])
        elif kind == wire.PING:
            router.send_multipart([peer, wire.PONG, rid, wire.dumps(self.status())])
        elif kind == wire.CONTROL and len(frames) == 4:
            self._pool.submit(self._control, peer, rid, frames[3])
        else:
            router.send_multipart([peer, wire.ERROR, rid, _error_body(
                wire.WireError(f"unknown message kind {kind!r} with {len(frames)} frames"))])

    def _query(self, peer: bytes, rid: bytes, header: bytes, raw: bytes) -> Optional[bytes]:
        """Submit one QUERY; returns an ERROR body when it is refused before it is queued."""
        if self.warming:
            return _error_body(EngineBusy("the engine server is warming up (compiling kernels, "
                                          "capturing graphs)", retry_after=2))
        try:
            # What arrives on the socket is checked here, once: the header against the key bytes'
            # length, keys sized by their own format (byte 18 of the first: v1 or v2), then the
            # keys' bytes as they are parsed; the engine checks their fit to its epoch.
            lane, domain_bits, query_keys = wire.unpack_query(
                header, len(raw), functools.partial(key_length_from_bytes, raw))
            keys = KeyBatch.from_bytes(raw, domain_bits)
            future = self.engine.submit_keys(keys, query_keys, lane)
        except BaseException as exc:  # noqa: BLE001 - refusals and bad input go back as ERROR
            return _error_body(exc)
        future.add_done_callback(lambda f: self._answered(peer, rid, f))
        return None


def _error_body(exc: BaseException) -> bytes:
    if isinstance(exc, EngineOverloaded):
        kind, retry = wire.OVERLOADED, exc.retry_after
    elif isinstance(exc, EngineBusy):
        kind, retry = wire.UNAVAILABLE, exc.retry_after
    elif isinstance(exc, (ValueError, KeyFormatError)):
        kind, retry = wire.INVALID, 0
    else:
        log.error("engine server: unexpected error %r", exc)
        kind, retry = wire.UNAVAILABLE, 5
    reason = exc.reason if isinstance(exc, EngineBusy) else str(exc)
    return wire.dumps({"kind": kind, "reason": reason, "retry_after": retry})


def _remove_socket(path: str, made: int) -> None:
    """Remove the ipc socket this server bound (ZeroMQ leaves the file behind), unless another
    server has bound the path since: ZeroMQ's bind replaces a file there with its own."""
    try:
        if os.stat(path).st_ino == made:
            os.unlink(path)
    except OSError:
        pass

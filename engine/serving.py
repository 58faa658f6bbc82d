"""The engine server process: build this party's Engine, warm it up, serve it over ZeroMQ.

Other apps add control operations (an epoch switch, "apply the row updates just stored") with
`register_control` from their ready(); the server runs them in its own process, where the
Engine is, and web or worker processes call them through their RemoteEngine.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable, Dict

from django.db import close_old_connections

from gpu_engine.server import EngineServer
from engine import holder

log = logging.getLogger(__name__)

# name -> fn(engine, args) -> JSON-able result; raising reports the error to the caller
ControlFn = Callable[[Any, Dict[str, Any]], Any]
_controls: Dict[str, ControlFn] = {}


def register_control(name: str, fn: ControlFn) -> None:
    """Offer `fn` to engine clients as control operation `name` (called from AppConfig.ready)."""
    _controls[name] = fn


def _bound(engine, fn: ControlFn) -> Callable[[Dict[str, Any]], Any]:
    def run(args: Dict[str, Any]) -> Any:
        # Control operations run on the server's pool threads: each query opens its own
        # connection, closed here so none is left to time out between calls.
        close_old_connections()
        try:
            return fn(engine, args)
        finally:
            close_old_connections()

    return run


def _placed(engine) -> str:
    """Where the pages are, in the ready line: "one device" or "shard over cuda:0, cuda:1"."""
    placed = engine.health()["placement"]
    if placed["placement"] == "single":
        return "one device"
    return f"{placed['placement']} over {', '.join(d['device'] for d in placed['devices'])}"


def serve(url: str, warm: bool = True, stop: threading.Event | None = None) -> int:
    """Run the engine server on `url` until SIGTERM/SIGINT (or `stop`); returns an exit status."""
    started = time.monotonic()
    holder.become_engine_server()
    engine = holder.get_engine()  # loads the matrix, follows policies and epochs live
    server = EngineServer(engine, url, {name: _bound(engine, fn) for name, fn in _controls.items()})
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    server.start()
    try:
        if warm:
            max_batch = max(policy.max_batch for policy in engine.policies().values())
            engine.warm_up(max_batch).result()
        server.mark_ready()
        print(f"engine server ready on {url} in {time.monotonic() - started:.1f} s "
              f"(epoch {engine.epoch.epoch_id}, {engine.epoch.matrix.num_pages} pages, "
              f"backend {engine.backend.name}, {_placed(engine)})", flush=True)
        while not stop.wait(0.5):
            if not engine.running:
                log.error("engine stopped (%s); exiting so the supervisor restarts the server",
                          engine.failure)
                return 1
        return 0
    finally:
        server.stop()
        holder.shutdown_engine()

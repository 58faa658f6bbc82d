"""This process's PIR engine: a client of the engine server, or an Engine built here; one per process.

With MORPHO_ENGINE_URL set, every web and Celery process shares the engine server's one Engine
through a RemoteEngine (the same interface); the engine server itself, and any process without
the setting (tests, runserver), builds its own Engine from the engine settings, once, shared by
every thread. Other apps hook into a built engine through engine.signals.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Optional

from engine.config import engine_settings
from engine.errors import EngineStartFailed
from engine.signals import engine_built, engine_started, starting_epoch
from gpu_engine.backends import factory
from gpu_engine.engine import Engine
from gpu_engine.interface import QueryEngine
from gpu_engine.matrix import load_epoch
from gpu_engine.placement import create_device_group
from gpu_engine.remote import RemoteEngine

log = logging.getLogger(__name__)

_lock = threading.Lock()
_engine = None
# The process that built _engine: a forked child (gunicorn --preload, Celery prefork) inherits
# the object but not its scheduler thread, so it must build its own.
_engine_pid: Optional[int] = None
# (reason, monotonic time) of the last failed start, so a broken configuration is not retried
# (reloading a matrix, probing a GPU) on every request.
_failure: Optional[tuple[str, float]] = None


# True in the engine server's process: it builds the Engine even though MORPHO_ENGINE_URL is set.
_serving = False


def become_engine_server() -> None:
    """This process owns the device: get_engine() builds the Engine here from now on."""
    global _serving
    _serving = True


def is_remote() -> bool:
    """True where queries go to an engine server in another process."""
    return engine_settings().remote and not _serving


def get_engine() -> QueryEngine:
    """This process's engine (local or remote); raises EngineStartFailed when one cannot be built."""
    global _engine, _engine_pid, _failure
    if is_remote():
        return _remote_engine()
    engine = _engine
    if engine is not None and _engine_pid == os.getpid():
        return engine
    with _lock:
        if _engine is not None and _engine_pid == os.getpid():
            return _engine
        _engine = None
        retry_after = engine_settings().retry_after_s
        if _failure is not None and time.monotonic() - _failure[1] < retry_after:
            raise EngineStartFailed(_failure[0], retry_after)
        try:
            engine = _build_engine()
        except Exception as exc:  # any start failure is reported as 503 with its reason
            reason = f"engine failed to start: {exc}"
            log.exception("%s", reason)
            _failure = (reason, time.monotonic())
            raise EngineStartFailed(reason, retry_after) from exc
        _engine, _engine_pid, _failure = engine, os.getpid(), None
        return engine


def _remote_engine():
    global _engine, _engine_pid
    engine = _engine
    if engine is not None and _engine_pid == os.getpid():
        return engine
    with _lock:
        if _engine is None or _engine_pid != os.getpid():
            # A forked child (gunicorn, Celery prefork) cannot use its parent's sockets or thread.
            config = engine_settings()
            _engine = RemoteEngine(config.url, config.deadline_s)
            _engine_pid = os.getpid()
        return _engine


def peek_engine() -> Optional[QueryEngine]:
    """The engine (local or remote) if this process has one, else None; never builds one."""
    engine = _engine
    return engine if engine is not None and _engine_pid == os.getpid() else None


def local_engine():
    """The Engine running in this process, or None (none yet, or the engine is remote)."""
    return None if is_remote() else peek_engine()


def remote_engine():
    """The RemoteEngine of this process where the engine is remote, else None."""
    return get_engine() if is_remote() else None


def shutdown_engine() -> None:
    """Stop and forget this process's engine (at exit; tests use it to load another matrix)."""
    global _engine, _engine_pid, _failure
    with _lock:
        engine, owner = _engine, _engine_pid
        _engine, _engine_pid, _failure = None, None, None
    if engine is not None and owner == os.getpid():
        engine.stop()


def _build_engine():
    config = engine_settings()
    path = config.matrix_path
    requested = config.backend
    if config.devices:
        backend = create_device_group(requested, config.devices, v2_scan=config.v2_scan,
                                      layout=config.matrix_layout)
    else:  # looked up here: tests put a device in its place
        backend = factory.create_backend(requested, v2_scan=config.v2_scan, layout=config.matrix_layout)
    if backend.fallback_reason:
        log.warning(
            "engine backend %s (requested %s; fell back because: %s)",
            backend.name, requested, backend.fallback_reason,
        )
    else:
        log.info("engine backend %s (requested %s)", backend.name, requested)
    if config.gil_switch_interval_us:
        sys.setswitchinterval(config.gil_switch_interval_us / 1e6)
    engine = _engine_on_starting_epoch(backend)
    if engine is None:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"matrix file {path} does not exist (MORPHO_MATRIX_PATH); make one with "
                f"`python manage.py make_matrix --pages 8192 --seed 1 --out {path}`"
            )
        epoch = load_epoch(path, domain_bits=config.domain_bits)
        _log_serving(epoch, path)
        engine = Engine(backend, epoch)
    # Batching follows the active policy records live, in every process (the policies app).
    engine_built.send(sender=Engine, engine=engine)
    engine.start()
    # Before any query: switch to the database's active epoch and apply its pending row updates
    # (the epochs app).
    engine_started.send(sender=Engine, engine=engine)
    return engine


def _log_serving(epoch, source) -> None:
    matrix = epoch.matrix
    log.info("serving epoch %s (block %s) from %s: %d pages, domain_bits %d", epoch.epoch_id,
             epoch.block_number, source, matrix.num_pages, matrix.domain_bits)


def _engine_on_starting_epoch(backend) -> Optional[Engine]:
    """An Engine on the epoch a starting_epoch receiver names (the party's active epoch), or None
    to start from the matrix file: none named, or that epoch cannot be placed on `backend` (the
    epochs app then holds the engine with the reason, as after a failed switch)."""
    for receiver, epoch in starting_epoch.send_robust(sender=Engine):
        if isinstance(epoch, Exception):
            log.warning("starting epoch: %s failed (%s); starting from the matrix file",
                        getattr(receiver, "__qualname__", receiver), epoch)
        elif epoch is not None:
            try:
                engine = Engine(backend, epoch)
            except Exception as exc:  # a placement the devices cannot make, a device error
                log.warning("epoch %s cannot be served here (%s); starting from the matrix file",
                            epoch.epoch_id, exc)
                return None
            _log_serving(epoch, epoch.matrix.source)
            return engine
    return None


atexit.register(shutdown_engine)

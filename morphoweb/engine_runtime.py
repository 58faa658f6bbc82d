"""This process's PIR Engine: built lazily from settings, started once, shared by every thread."""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Optional

from django.conf import settings

log = logging.getLogger(__name__)


class EngineStartFailed(Exception):
    """The engine could not be built (no matrix, backend unavailable); the API answers 503."""

    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


_lock = threading.Lock()
_engine = None
# The process that built _engine: a forked child (gunicorn --preload, Celery prefork) inherits
# the object but not its scheduler thread, so it must build its own.
_engine_pid: Optional[int] = None
# (reason, monotonic time) of the last failed start, so a broken configuration is not retried
# (reloading a matrix, probing a GPU) on every request.
_failure: Optional[tuple[str, float]] = None


def get_engine():
    """The started Engine of this process; raises EngineStartFailed when it cannot be built."""
    global _engine, _engine_pid, _failure
    engine = _engine
    if engine is not None and _engine_pid == os.getpid():
        return engine
    with _lock:
        if _engine is not None and _engine_pid == os.getpid():
            return _engine
        _engine = None
        retry_after = settings.MORPHO_ENGINE_RETRY_AFTER
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


def peek_engine():
    """The engine if this process has started one, else None; never builds one."""
    engine = _engine
    return engine if engine is not None and _engine_pid == os.getpid() else None


def shutdown_engine() -> None:
    """Stop and forget this process's engine (at exit; tests use it to load another matrix)."""
    global _engine, _engine_pid, _failure
    with _lock:
        engine, owner = _engine, _engine_pid
        _engine, _engine_pid, _failure = None, None, None
    if engine is not None and owner == os.getpid():
        engine.stop()


def _build_engine():
    # Imported here so that importing settings-level modules does not load NumPy/CuPy.
    from gpu_engine.backends import create_backend
    from gpu_engine.engine import Engine
    from gpu_engine.matrix import load_epoch

    path = settings.MORPHO_MATRIX_PATH
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"matrix file {path} does not exist (MORPHO_MATRIX_PATH); make one with "
            f"`python manage.py make_matrix --pages 8192 --seed 1 --out {path}`"
        )
    requested = settings.MORPHO_ENGINE_BACKEND
    backend = create_backend(requested)
    if backend.fallback_reason:
        log.warning(
            "engine backend %s (requested %s; fell back because: %s)",
            backend.name, requested, backend.fallback_reason,
        )
    else:
        log.info("engine backend %s (requested %s)", backend.name, requested)
    epoch = load_epoch(path, domain_bits=settings.MORPHO_DOMAIN_BITS)
    matrix = epoch.matrix
    log.info(
        "serving epoch %s (block %s) from %s: %d pages, domain_bits %d",
        epoch.epoch_id, epoch.block_number, path, matrix.num_pages, matrix.domain_bits,
    )
    if settings.MORPHO_GIL_SWITCH_INTERVAL_US:
        sys.setswitchinterval(settings.MORPHO_GIL_SWITCH_INTERVAL_US / 1e6)
    engine = Engine(backend, epoch)
    # Batching follows the active policy records live, in every process (policies.bridge).
    from policies.bridge import attach

    attach(engine)
    engine.start()
    # Before any query: switch to the database's active epoch and apply its pending row updates.
    from epochs.runtime import adopt

    adopt(engine)
    return engine


atexit.register(shutdown_engine)

"""The cross-process watcher: one thread per process polls cheap version functions and applies
changes another process made (an admin's policy edit, an epoch switch) within a second.

Why polling: a post_save signal fires only in the process that saved, a local-memory cache is per
process, and a cache TTL leaves other processes stale for the whole TTL. One small query every
POLL_S per process (not per request) reaches web servers and Celery workers alike.

Usage (the policies and epochs apps): `register("policies", version_fn, apply_fn)`;
`version_fn()` returns any comparable value (cheap: an aggregate over an indexed column),
`apply_fn(version)` reloads whatever it guards. The thread starts on the first registration and
again in a forked child (gunicorn, Celery prefork)."""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from django.db import connection

log = logging.getLogger(__name__)

POLL_S = 0.25  # seconds between polls: a change is seen within POLL_S plus one query
_UNSEEN = object()


@dataclass
class _Watch:
    version_fn: Callable[[], Any]
    apply_fn: Callable[[Any], None]
    seen: Any = field(default=_UNSEEN)
    failing: bool = False


class Watcher:
    """Runs every registered watch each `poll_s` seconds on one daemon thread."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self._watches: Dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._pid: Optional[int] = None

    def register(self, name: str, version_fn: Callable[[], Any], apply_fn: Callable[[Any], None],
                 check_now: bool = True) -> None:
        """Watch `name` (re-registering replaces it); with check_now, apply once before returning."""
        watch = _Watch(version_fn, apply_fn)
        with self._lock:
            self._watches[name] = watch
        if check_now:
            self._check(name, watch)
        self.start()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
                return
            self._stop.clear()
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="live-watcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def check(self, name: str) -> None:
        """One poll of `name` now, in this thread (nothing if it is not watched)."""
        with self._lock:
            watch = self._watches.get(name)
        if watch is not None:
            self._check(name, watch)

    def check_all(self) -> None:
        """One round of polls (the thread's body; tests call it directly)."""
        with self._lock:
            watches = list(self._watches.items())
        for name, watch in watches:
            self._check(name, watch)

    def _check(self, name: str, watch: _Watch) -> None:
        try:
            version = watch.version_fn()
            if version != watch.seen:
                watch.apply_fn(version)
                watch.seen = version
            if watch.failing:
                log.info("live watch %s recovered", name)
            watch.failing = False
        except Exception:  # noqa: BLE001 - keep the last applied state, try again next poll
            if not watch.failing:
                log.exception("live watch %s failed; keeping what was applied last", name)
            watch.failing = True
            _reset_db_connection()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self.check_all()
        finally:
            _reset_db_connection()  # a stopped watcher holds no database connection open


def _reset_db_connection() -> None:
    # A broken connection (database restarted) stays broken in this long-lived thread unless
    # closed; the next query opens a fresh one.
    try:
        connection.close()
    except Exception:  # noqa: BLE001 - nothing more to do here
        pass


_default = Watcher()


def register(name: str, version_fn: Callable[[], Any], apply_fn: Callable[[Any], None],
             check_now: bool = True) -> None:
    """Watch `name` on this process's shared watcher thread."""
    _default.register(name, version_fn, apply_fn, check_now)


def default_watcher() -> Watcher:
    return _default

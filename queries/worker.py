"""The Celery worker process of a party: the bulk sweeper, its fork guard, the broker watch,
the engine's warm-up. Connected by QueriesConfig.ready(); its receivers run in workers only."""

from __future__ import annotations

import logging
import os
import threading
import time

from celery import bootsteps
from celery.signals import worker_init, worker_process_init, worker_ready, worker_shutdown
from django.conf import settings
from django.db import DatabaseError, connections
from django.template.defaultfilters import pluralize
from django.utils import timezone

from engine.errors import EngineStartFailed
from engine.holder import get_engine
from queries import bulk
from queries.models import BulkChunk, JobStatus

log = logging.getLogger(__name__)

_sweeper_started = threading.Event()
_stop = threading.Event()
_wake = threading.Event()
# Held by the sweeper for each pass and by every fork of this process (os.register_at_fork).
# The worker's main process forks a new pool process whenever one dies (billiard's supervisor
# thread), and a child gets only the forking thread: a lock another thread held at that moment
# stays held in the child for good. A pass runs inside SQLite (whose allocator mutex it takes at
# every query), the database driver, the broker client and logging; a pool process forked in the
# middle of one blocked on its first query (it had inherited SQLite's mutex, locked) and the
# worker consumed nothing more, its one prefetched task handed to that process. Forks wait for the
# pass to end, and a pass ends with this thread's connections closed, so a child inherits neither
# a held lock nor an open database file or socket.
_fork_guard = threading.RLock()
# When this worker's consumer last lost the broker; set by BrokerWatch, read by the sweeper.
_broker_lost_at: list = []


def forget_own_leases(worker: str) -> int:
    """A worker that starts holds no chunk: chunks its previous life held are free at once."""
    return BulkChunk.objects.filter(status=JobStatus.RUNNING, worker=worker).update(
        lease_expires=timezone.now()
    )


class BrokerWatch(bootsteps.StartStopStep):
    """Tells the sweeper when the consumer reconnects: a restarted broker lost every message.

    Celery restarts the consumer's steps after a connection error (stop, then start once the
    broker answers again). The moment of the stop is kept; at the next start the sweeper resends
    every queued chunk sent before it (bulk.resend_sent_before) instead of waiting
    MORPHO_BULK_REQUEUE_SECONDS for the queue to look stalled."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c, **kwargs) -> None:
        super().__init__(c, **kwargs)
        self.lost_at = None

    def start(self, c) -> None:
        if self.lost_at is not None:
            log.warning("connected to the broker again; resending bulk chunks it may have lost")
            _broker_lost_at.append(self.lost_at)
            self.lost_at = None
            _wake.set()

    def stop(self, c) -> None:
        # Called on a connection error (before reconnecting; again if a reconnection fails
        # half-way, hence the first moment is kept) and at shutdown.
        if self.lost_at is None:
            self.lost_at = timezone.now()


def _watch_broker(sender=None, **kwargs) -> None:
    # Runs before the worker builds its consumer, so the step is part of it.
    sender.app.steps["consumer"].add(BrokerWatch)


def _sweep_once() -> None:
    while _broker_lost_at:
        resent = bulk.resend_sent_before(_broker_lost_at[0])
        _broker_lost_at.pop(0)  # only once done: a failed resend is tried again next sweep
        log.warning(
            "broker came back: %d queued bulk chunk%s sent again", resent, pluralize(resent)
        )
    bulk.sweep()


def _forget_own_leases(worker: str) -> None:
    try:
        freed = forget_own_leases(worker)
    except DatabaseError:
        log.exception("could not release this worker's old leases")
        return
    if freed:
        log.warning(
            "%s: %d chunk%s held by this worker's previous run %s free again",
            worker, freed, pluralize(freed), pluralize(freed, "is,are"),
        )


def _close_connections() -> None:
    # Closed whatever CONN_MAX_AGE says: nothing of a connection may be forked.
    try:
        connections.close_all()  # this thread's
    except Exception:  # Django drops the connection even when closing it fails
        log.exception("could not close the sweeper's database connection")


def _sweep_forever(worker: str) -> None:
    with _fork_guard:
        try:
            _forget_own_leases(worker)
        finally:
            _close_connections()
    while not _stop.is_set():
        _wake.clear()
        with _fork_guard:
            try:
                _sweep_once()
            except Exception:  # a broken database or broker must not kill the thread
                log.exception(
                    "bulk sweep failed; trying again in %s s", settings.MORPHO_BULK_SWEEP_SECONDS
                )
            finally:
                _close_connections()
        _wake.wait(settings.MORPHO_BULK_SWEEP_SECONDS)


def _before_fork() -> None:
    _fork_guard.acquire()  # waits for the sweep pass under way, if any


def _after_fork_in_parent() -> None:
    _fork_guard.release()


def _after_fork_in_child() -> None:
    global _fork_guard
    _fork_guard = threading.RLock()  # the child has no sweeper; its own forks need not wait


def _start_sweeper(sender=None, **kwargs) -> None:
    # The main worker process sweeps (it outlives pool children); once, even if the consumer
    # reconnects to the broker and signals ready again.
    if _sweeper_started.is_set():
        return
    _sweeper_started.set()
    # Registered last, so it runs before the other before-fork hooks (logging's takes its lock).
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
    worker = getattr(sender, "hostname", None) or "worker"
    threading.Thread(
        target=_sweep_forever, args=(worker,), name="bulk-sweeper", daemon=True
    ).start()


def _stop_sweeper(**kwargs) -> None:
    _stop.set()
    _wake.set()


def _warm_engine(**kwargs) -> None:
    # Load the matrix onto this process's device before the first chunk arrives; in a thread,
    # because Celery gives a pool process only a few seconds to start.
    def warm() -> None:
        started = time.monotonic()
        try:
            get_engine()
            log.info("engine ready in %.1f s", time.monotonic() - started)
        except EngineStartFailed as exc:
            log.error("engine did not start: %s (chunks retry until it does)", exc.reason)

    threading.Thread(target=warm, name="engine-warmup", daemon=True).start()


def connect() -> None:
    """Connect the worker's signal receivers (a Celery signal keeps one of each)."""
    worker_init.connect(_watch_broker, weak=False, dispatch_uid="morpho-broker-watch")
    worker_ready.connect(_start_sweeper, weak=False, dispatch_uid="morpho-bulk-sweeper")
    worker_shutdown.connect(_stop_sweeper, weak=False, dispatch_uid="morpho-bulk-sweeper-stop")
    worker_process_init.connect(_warm_engine, weak=False, dispatch_uid="morpho-engine-warmup")

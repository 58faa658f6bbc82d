"""Celery's prefork pool, with queue locks that a killed pool process gives back.

With a broker Celery cannot poll asynchronously (the filesystem transport, this project's default)
the worker runs billiard's threaded pool: one pipe carries the tasks to every pool process, one
carries their results back, and a process-shared lock (a semaphore) guards each end that several
processes use. An idle pool process waits for its next task inside the task pipe's read lock,
blocked in recv(). A semaphore has no owner: when that process is SIGKILLed (the OOM killer, an
operator, a crashed driver) nothing posts it again, the process started in its place blocks on
the lock for good, and the worker hands its one prefetched task to a process that never reads
it: the worker consumes nothing more. Here those locks are POSIX record locks (fcntl) on a file
the pool's processes share, which the kernel releases when their holder dies.

The event-loop pool (AsynPool, used with Redis or AMQP) gives each process its own pipes without
shared locks, and is left as it is.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import threading
import time

from billiard import get_start_method
from billiard.pool import Pool as ThreadedPool
from celery.concurrency import prefork


class DeathSafeLock:
    """A lock between the processes forked from the one that made it, released by the kernel
    when its holder dies: an exclusive record lock on one byte of a shared file, plus a thread
    lock for the threads of one process (record locks only exclude other processes)."""

    def __init__(self, file, offset: int) -> None:
        self._file = file  # kept open as long as the lock: closing any descriptor drops the locks
        self._fd = file.fileno()
        self._offset = offset
        self._pid = os.getpid()
        self._threads = threading.Lock()

    def _thread_lock(self) -> threading.Lock:
        if self._pid != os.getpid():  # a forked child: no thread of it holds this lock yet
            self._pid, self._threads = os.getpid(), threading.Lock()
        return self._threads

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        threads = self._thread_lock()
        if timeout is not None and timeout < 0:
            timeout = None
        deadline = None if timeout is None else time.monotonic() + timeout
        if not threads.acquire(block, -1 if timeout is None or not block else timeout):
            return False
        try:
            if block and deadline is None:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self._offset)
                return True
            while True:
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, self._offset)
                    return True
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        raise
                if not block or time.monotonic() >= deadline:
                    threads.release()
                    return False
                time.sleep(0.005)
        except BaseException:
            threads.release()
            raise

    def release(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._offset)
        self._threads.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

    def __getstate__(self):
        # Only forked processes share the file's descriptor (see DeathSafeQueuesPool).
        raise TypeError("a DeathSafeLock cannot be sent to another process; fork it")


class DeathSafeQueuesPool(ThreadedPool):
    """billiard's threaded pool whose task and result pipes are guarded by DeathSafeLocks."""

    def _setup_queues(self) -> None:
        super()._setup_queues()
        if (get_start_method(allow_none=True) or "fork") != "fork":
            return  # spawned children get the queues pickled: keep billiard's semaphores
        # Open while the pool lives (the locks hold it); unlinked already, so nothing to remove.
        self._queue_lock_file = tempfile.TemporaryFile(prefix="celery-pool-locks-")  # noqa: SIM115
        locks = [
            (q, name) for q in (self._inqueue, self._outqueue) for name in ("_rlock", "_wlock")
        ]
        for offset, (queue, name) in enumerate(locks):
            if getattr(queue, name, None) is not None:
                setattr(queue, name, DeathSafeLock(self._queue_lock_file, offset))


class TaskPool(prefork.TaskPool):
    """Celery's prefork pool (`--pool prefork`), with DeathSafeQueuesPool as its threaded pool."""

    BlockingPool = DeathSafeQueuesPool

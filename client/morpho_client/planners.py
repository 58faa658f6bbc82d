"""Key-making processes beside the client's event loop: windows of keys planned in parallel.

A fetch makes 3 DPF key pairs a row, a core's worth at tens of thousands of rows/s, while its
event loop reads the answers on one core. `Planners` runs `plan.plan_window` in processes of its
own (plain subprocesses, not multiprocessing: nothing of the calling program is imported again,
whatever its start method or main module), each drawing its keys' randomness from its own
os.urandom. A process reads requests on its stdin until it closes, so it ends with its client,
or with the program that made it however that program ends.
"""
from __future__ import annotations

import concurrent.futures
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Optional

import morpho_pir

from morpho_client.core import PirError

MAX_PLANNERS = 64
AUTO_PLANNERS = 2  # enough for the parties of one host: each makes 25,000 rows/s of keys at d = 20
STOP_WAIT_S = 2.0  # how long close() waits for a process to end on its own before killing it
_FRAME = struct.Struct("<Q")  # each message: its length, then its pickle
# The process's program: the client's packages from where this process found them, then serve().
_BOOT = ("import sys; sys.path[:0] = sys.argv[1:]; "
         "from morpho_client.planners import serve; serve()")


def auto_planners() -> int:
    """Key-making processes where the caller says None: AUTO_PLANNERS, fewer on a small host
    (one core is the event loop's), none on one core."""
    return max(0, min(AUTO_PLANNERS, (os.cpu_count() or 1) - 1))


def check_planners(value) -> Optional[int]:
    """`value` as a planner count (None: auto_planners() when a fetch needs them); ValueError
    saying what is allowed otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PLANNERS:
        raise ValueError(f"planners must be a whole number in 0..{MAX_PLANNERS} (0: keys made in "
                         f"this process; None: {auto_planners()} on this host), got {value!r}")
    return value


class PlannerError(PirError):
    """A key-making process ended or broke its protocol; the fetch cannot go on with it."""


def _pickle(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _send(stream, data: bytes) -> None:
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _read(stream) -> Optional[bytes]:
    """The next message's pickle, or None where the other side has closed the pipe."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    size = _FRAME.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return data


def _receive(stream):
    """The next message, or None where the other side has closed the pipe."""
    data = _read(stream)
    return None if data is None else pickle.loads(data)


def serve() -> None:
    """A key-making process: each request on stdin is a call (a function of the client's
    modules, by name, and its arguments), answered on stdout with what it returned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client stops it, by closing its stdin
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never between two answers
    _send(answers, _pickle(("ready", os.getpid())))
    while True:
        try:
            request = _receive(requests)
        except Exception as exc:  # noqa: BLE001 - a call it cannot read (a module it lacks)
            _send(answers, _pickle(("error", PlannerError(f"a call it could not read: {exc!r}"))))
            continue
        if request is None:
            return
        try:
            fn, args, kwargs = request
            reply = ("ok", fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the client raises it for its caller
            reply = ("error", exc)
        try:
            data = _pickle(reply)
        except Exception:  # noqa: BLE001 - what cannot be pickled is said in words
            data = _pickle(("error", PlannerError(f"{reply[0]}: {reply[1]!r:.200}")))
        _send(answers, data)


class _Process:
    """One key-making process and the thread that hands it requests, one at a time."""

    def __init__(self, owner: "_Pool", index: int) -> None:
        paths = sorted({str(Path(module.__file__).resolve().parent.parent)
                        for module in (morpho_pir, sys.modules["morpho_client"])})
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, *paths],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        self.owner = owner
        self.thread = threading.Thread(target=self._run, name=f"pir-planner-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        owner = self.owner
        try:
            try:
                hello = _receive(self.proc.stdout)
            except Exception:  # noqa: BLE001 - bytes that are no pickle: not a process of ours
                hello = None
            if not (isinstance(hello, tuple) and hello[0] == "ready"):
                owner._lost(self, f"did not start (exit status {self.proc.wait()})")
                return
            owner._ready(self)
            while True:
                job = owner._jobs.get()
                if job is None:
                    return
                args, future = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    _send(self.proc.stdin, args)
                    data = _read(self.proc.stdout)
                except (OSError, ValueError):
                    data = None
                if data is None:
                    lost = PlannerError(f"key-making process {self.proc.pid} ended "
                                        f"(exit status {self.proc.poll()}) during a fetch")
                    future.set_exception(lost)
                    owner._lost(self, str(lost))
                    return
                try:
                    reply = pickle.loads(data)
                except Exception as exc:  # noqa: BLE001 - read whole, so the next call is in step
                    # (an exception whose class pickles only some of its arguments, HexError's)
                    future.set_exception(PlannerError(f"an answer of key-making process "
                                                      f"{self.proc.pid} could not be read: {exc!r}"))
                    continue
                if reply[0] == "ok":
                    with owner._lock:
                        owner.planned += 1
                    future.set_result(reply[1])
                else:
                    future.set_exception(reply[1])
        except (OSError, ValueError) as exc:  # its pipes closed under it: the owner closes
            owner._lost(self, repr(exc))

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # its loop reads end-of-file and returns
        except OSError:
            pass

    def reap(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Pool:
    """The processes, their threads and the queue of windows: what the threads hold, so that a
    Planners nobody holds is collected, and its finalizer closes this."""

    def __init__(self, count: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = count
        self._ready_count = 0
        self.planned = 0  # windows the processes have planned
        self._broken: Optional[str] = None
        self._closed = False
        self._local = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pir-plan")
        self.processes: list[_Process] = []
        try:
            for index in range(count):
                self.processes.append(_Process(self, index))
        except BaseException:  # a process that could not start: those that did are ended
            self.close()
            raise

    def _ready(self, process: _Process) -> None:
        with self._lock:
            self._ready_count += 1

    def _lost(self, process: _Process, why: str) -> None:
        with self._lock:
            self._live -= 1
            if self._closed or self._live > 0:
                return
            self._broken = why
        # no process is left to take the queued windows: each fails, saying why
        for future in self._queued():
            if future.set_running_or_notify_cancel():
                future.set_exception(PlannerError(f"no key-making process left: {why}"))

    def _queued(self):
        """The futures of the windows still queued, taken off the queue."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                yield job[1]

    def submit(self, fn, args, kwargs) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise PlannerError("the key-making processes are closed")
            if self._broken is not None:
                raise PlannerError(f"no key-making process left: {self._broken}")
            if self._ready_count == 0:
                return self._local.submit(fn, *args, **kwargs)
            future: concurrent.futures.Future = concurrent.futures.Future()
            # pickled here, so that what cannot be sent fails in the caller's hands
            self._jobs.put((_pickle((fn, args, kwargs)), future))
            return future

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for future in self._queued():
            future.cancel()
        for _ in self.processes:
            self._jobs.put(None)
        for process in self.processes:
            process.stop()
        for process in self.processes:
            process.reap(STOP_WAIT_S)
        for process in self.processes:
            if process.thread is not threading.current_thread():  # a finalizer may run on it
                process.thread.join(STOP_WAIT_S)  # its process gone, its read has ended
            process.proc.stdout.close()
        self._local.shutdown(wait=False, cancel_futures=True)


class Planners(concurrent.futures.Executor):
    """`count` key-making processes, started at once and ready a moment later, as an Executor
    (loop.run_in_executor takes it): submit(plan_window, rows, ...) runs on a process that is
    free, or on a thread of this process while none has started yet, so that a fetch never
    waits for them. The function and its arguments are pickled, so the function is one of a
    module's (plan.plan_window, a lookup's planner). close() ends them all, as does the
    collection of a Planners nobody closed, and the program's exit."""

    def __init__(self, count: int) -> None:
        if check_planners(count) is None or count < 1:
            raise ValueError(f"Planners needs 1..{MAX_PLANNERS} processes, got {count!r}")
        self._pool = _Pool(count)
        self._close = weakref.finalize(self, self._pool.close)

    @property
    def pids(self) -> list[int]:
        return [p.proc.pid for p in self._pool.processes]

    @property
    def ready(self) -> int:
        """Processes that have started and take windows."""
        return self._pool._ready_count

    @property
    def planned(self) -> int:
        """Windows the processes have planned."""
        return self._pool.planned

    @property
    def broken(self) -> bool:
        """Whether every process has ended: submit() refuses, and a new Planners is needed."""
        return self._pool._broken is not None

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        """fn(*args, **kwargs) on a process that is free (or on this process's thread while
        none has started yet)."""
        return self._pool.submit(fn, args, kwargs)

    def close(self) -> None:
        """End every process (stdin closed, then killed after STOP_WAIT_S) and its thread;
        windows not yet planned are cancelled."""
        self._close()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Executor's name for close(): windows not yet planned are cancelled either way."""
        self.close()

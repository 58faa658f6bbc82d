"""The front end's processes: one listening socket, forked into several that each accept from it.

One Python process proxies a few thousand requests a second; gunicorn behind it serves more with
several processes, so the front end has several too (MORPHO_FRONTEND_PROCESSES). The first one
binds the port and forks the others, which accept from the same socket, so no request waits for
one busy process while another is idle. A process that dies stops the rest (the supervisor, as
under `make run`, then stops the party); a forked one also stops when the first one dies.
"""
from __future__ import annotations

import logging
import os
import signal

from morphoweb.partyprocs import end_with_parent

log = logging.getLogger("morphoweb.frontend")


class Processes:
    """The forked processes of one front end, seen from the process that forked them."""

    def __init__(self, count: int) -> None:
        self.count = max(1, count)
        self.children: list[int] = []
        self.forked = False  # True in a forked process
        self.stopping = False
        self.failed: list[str] = []  # how the processes that died unasked ended

    def fork(self) -> None:
        """Fork count - 1 processes; each returns from here with `forked` set. Call it before
        any event loop or thread exists: a fork copies only the calling thread."""
        for _ in range(self.count - 1):
            pid = os.fork()
            if pid == 0:
                self.forked, self.children = True, []
                # the first process's end is this one's: no process is left holding the port
                end_with_parent()
                if os.getppid() == 1:  # the first one died before the call above
                    os._exit(1)
                return
            self.children.append(pid)

    def reap(self) -> bool:
        """Collect the forked processes that ended; True if one ended before it was asked to."""
        died = False
        for pid in list(self.children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            self.children.remove(pid)
            if not self.stopping:
                code = os.waitstatus_to_exitcode(status)
                self.failed.append(f"front end process {pid} exited with status {code}")
                log.error("%s: stopping the front end", self.failed[-1])
                died = True
        return died

    def stop(self) -> None:
        """Ask every forked process to stop (SIGTERM: each lets its requests finish)."""
        self.stopping = True
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        """Wait for every forked process; the exit status of this front end (1 if one failed)."""
        for pid in self.children:
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                self.failed.append(f"front end process {pid} exited with status "
                                   f"{os.waitstatus_to_exitcode(status)}")
        self.children = []
        return 1 if self.failed else 0

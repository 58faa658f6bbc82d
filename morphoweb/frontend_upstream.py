"""The front end's connections to gunicorn (morphoweb/frontend.py): one exchange at a time each,
and kept for the next request where gunicorn keeps them (an answer with a length, keep-alive), so
that a request costs neither side a connection's setup."""
from __future__ import annotations

import asyncio
from typing import Optional

from morphoweb.spool import Spool

SPOOL_MEMORY_BYTES = 1 << 20  # a body or answer beyond this goes to a temporary file
MAX_SPOOL_BYTES = 1 << 30  # an answer this far ahead of its slow reader pauses gunicorn's socket
CHUNK_BYTES = 64 * 1024
# A kept connection idle longer is closed rather than used: gunicorn closes its own after its
# keepalive setting (2 s), and a request sent just as it does would have to be sent again.
POOL_IDLE_S = 1.0


class Upstream(asyncio.Protocol):
    """A connection to gunicorn, one exchange at a time: the request written with flow control,
    the answer read as fast as it comes into a spool (memory, then a temporary file), its head
    split off."""

    def __init__(self, max_head: int) -> None:
        self.max_head = max_head
        self.closed = False  # gunicorn closed (or reset) the connection
        self.changed = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.transport: Optional[asyncio.Transport] = None
        self.idle_since = 0.0  # loop time it went back to the pool
        self.next_exchange()

    def next_exchange(self) -> None:
        """Forget the last answer: the connection serves another request."""
        self.head = bytearray()
        self.head_done = False
        self.body = Spool(SPOOL_MEMORY_BYTES)
        self.reset = False  # gunicorn closed before it was done: the answer may be cut short
        self.paused = False
        self.reusable = False  # set by the relay: the answer ended at its length, kept alive
        self.changed.clear()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.head_done:
            self.body.write(data)
        else:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end >= 0:
                self.body.write(bytes(self.head[end + 4:]))
                del self.head[end + 4:]
                self.head_done = True
            elif len(self.head) > self.max_head:
                self.transport.abort()
        if self.body.pending > MAX_SPOOL_BYTES and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self.changed.set()

    def eof_received(self) -> bool:
        self.closed = True
        self.changed.set()
        return False

    def connection_lost(self, exc) -> None:
        self.reset = self.reset or (exc is not None and not self.closed)
        self.closed = True
        self.writable.set()
        self.changed.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    async def send(self, data: bytes, timeout: float) -> bool:
        """Write data; False once gunicorn has closed the connection (it may have answered)."""
        if self.closed or self.transport.is_closing():
            return False
        self.transport.write(data)
        if not self.writable.is_set():
            async with asyncio.timeout(timeout):
                await self.writable.wait()
        return not self.closed

    async def wait(self, timeout: float) -> None:
        """Until more of the answer (or the end) arrives; TimeoutError after `timeout` s."""
        self.changed.clear()
        async with asyncio.timeout(timeout):
            await self.changed.wait()

    def read(self) -> bytes:
        data = self.body.read(CHUNK_BYTES)
        if self.paused and self.body.pending < MAX_SPOOL_BYTES // 2:
            self.transport.resume_reading()
            self.paused = False
        return data


class Pool:
    """The connections to gunicorn that answered their last request and stay open, the most
    recently used first out."""

    def __init__(self) -> None:
        self.idle: list[Upstream] = []

    def take(self) -> Optional[Upstream]:
        now = asyncio.get_running_loop().time()
        while self.idle:
            upstream = self.idle.pop()
            if not upstream.closed and now - upstream.idle_since < POOL_IDLE_S:
                upstream.next_exchange()
                return upstream
            upstream.transport.abort()
        return None

    def give(self, upstream: Upstream) -> None:
        """Keep `upstream` if its answer left it ready for another; else close it."""
        if not (upstream.reusable and not upstream.closed and not upstream.body.pending):
            upstream.transport.abort()
            upstream.body.close()
            return
        upstream.body.close()
        now = asyncio.get_running_loop().time()
        upstream.idle_since = now
        self.idle.append(upstream)
        while self.idle and now - self.idle[0].idle_since >= POOL_IDLE_S:
            self.idle.pop(0).transport.abort()

    def close(self) -> None:
        for upstream in self.idle:
            upstream.transport.abort()
        self.idle.clear()

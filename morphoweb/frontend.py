"""The front end of `make run`: an asyncio reverse proxy that reads each request whole first.

gunicorn gives each connection a thread from the moment it sends its first byte, so a few clients
that trickle their headers would hold every thread. Here a slow client costs a socket and a
coroutine: the head must arrive within MORPHO_FRONTEND_HEADER_TIMEOUT, the body (by its
Content-Length, spooled to a temporary file past 1 MiB) at a minimum rate, and only then is a
connection to gunicorn opened and the request sent at once, with the client's address in
X-Forwarded-For. The answer is read from gunicorn as fast as it comes (so its thread is free
again) and relayed to the client at the client's pace; a connection's next request is read only
once its reader has taken all but ANSWER_BUFFER_BYTES of the last answer, so a client that
pipelines requests and reads none of the answers has one request in gunicorn at a time, and no
more once its answers pile up. Every error answered here is JSON in the API's shape (detail,
errors[{field, code, message}]). Several processes (MORPHO_FRONTEND_PROCESSES) share the port,
each with its own uvloop event loop, and each holds at most its share of
MORPHO_FRONTEND_MAX_CONNECTIONS connections: a new one beyond that closes the connection that has
waited longest without a request in gunicorn (idle, or a head still arriving), or, where every
connection has one, is refused with 503.

    python -m morphoweb.frontend --listen 127.0.0.1:8001 --upstream unix:var/web-a.sock
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import re
import resource
import signal
import socket
import struct
import termios
from dataclasses import dataclass
from typing import Optional
from urllib.parse import unquote, urlsplit

import uvloop
from django.conf import settings

from morphoweb.httphead import (
    MAX_FIELD_BYTES, Refusal, Request, check_line, declared_length, parse_head, refusal_bytes,
    refuse,
)
from morphoweb.frontend_procs import Processes
from morphoweb.frontend_upstream import CHUNK_BYTES, SPOOL_MEMORY_BYTES, Pool, Upstream
from morphoweb.spool import Spool

log = logging.getLogger("morphoweb.frontend")

CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 2  # gunicorn not accepting connections: starting, restarting or stopped
SHUTDOWN_GRACE_S = 5.0  # requests in flight at SIGTERM get this long to finish
LINGER_S = 2.0  # after an early answer (408, 413, ...) what the client still sends is read so long
# A connection's next request waits until no more than this much of its last answer is still
# unsent (in the front end's buffer and the kernel's send queue): a 32-query answer is 128-256 KiB.
ANSWER_BUFFER_BYTES = 64 * 1024
# A connection over that bound looks again when its next request starts, else after 1 ms, then at
# doubling gaps up to 10 ms: a fixed 10 ms wait would add about 5 ms to each request of a client
# that reads its answers (a fifth of a 32-query batch's time at 65,536 pages on a GPU).
TAKEN_POLL_S = (0.001, 0.002, 0.004, 0.008, 0.01)
CHILD_POLL_S = 0.5  # how often the first process looks whether the forked ones still run
STATUS_LINE = re.compile(rb"HTTP/1\.[01] [1-5][0-9][0-9][ \r]")
# Headers about one connection, not the request: the front end sets its own to gunicorn.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
              "upgrade", "expect", "content-length"}
# What a client must not claim on its own: its address and its scheme are the front end's to say.
FORWARDED = {"x-forwarded-for", "x-forwarded-proto", "x-forwarded-protocol", "x-forwarded-ssl",
             "x-forwarded-host", "forwarded"}


@dataclass
class Limits:
    """The front end's deadlines (seconds) and sizes (bytes): settings MORPHO_FRONTEND_*."""

    header_timeout: float
    max_header_bytes: int
    body_timeout: float
    body_min_rate: int
    keepalive_timeout: float
    send_timeout: float
    upstream_timeout: float
    max_connections: int  # of one process: its share of the setting, within its descriptors

    @classmethod
    def from_settings(cls, processes: int = 1) -> "Limits":
        values = {name: getattr(settings, f"MORPHO_FRONTEND_{name.upper()}")
                  for name in cls.__dataclass_fields__}
        # a connection in flight holds two descriptors (client, gunicorn), a few more are the
        # process's own
        files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        values["max_connections"] = max(1, min(-(-values["max_connections"] // processes),
                                               (files - 64) // 2))
        return cls(**values)


class FrontEnd:
    """Serves one listening socket, each request forwarded to `upstream` (HOST:PORT, unix:PATH)."""

    def __init__(self, upstream: str, limits: Limits) -> None:
        self.upstream, self.limits = upstream, limits
        self.upstream_down = False  # logged once per outage, not once per request
        self.connections: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self.pool = Pool()
        # The connections without a request in gunicorn, longest waiting first: the ones a new
        # connection may push out when this process holds all it may.
        self.waiting: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self.full_logged = False

    async def stop(self) -> None:
        """Let the requests in flight finish for a moment, then end every connection (each
        handler then returns by itself: asyncio's cancellation of them would log errors)."""
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=SHUTDOWN_GRACE_S)
        self.pool.close()
        for writer in list(self.connections.values()):
            writer.transport.abort()
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=SHUTDOWN_GRACE_S)

    def make_room(self) -> bool:
        """At the connection bound: close the longest-waiting connection without a request in
        gunicorn; False when every connection has one."""
        if len(self.connections) < self.limits.max_connections:
            return True
        if not self.full_logged:
            log.warning("front end holds %d connections, its bound: the longest waiting ones "
                        "are closed for new ones (MORPHO_FRONTEND_MAX_CONNECTIONS)",
                        len(self.connections))
            self.full_logged = True
        if not self.waiting:
            return False
        task = next(iter(self.waiting))
        self.waiting.pop(task).transport.abort()
        self.connections.pop(task, None)
        return True

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if not self.make_room():
            await self.reply(writer, refuse(
                503, "server", "busy", f"this front end holds {len(self.connections)} "
                "connections, each with a request in progress; try again",
                {"Retry-After": str(RETRY_AFTER_S)}))
            writer.transport.abort()
            return
        self.connections[task] = self.waiting[task] = writer
        peer = writer.get_extra_info("peername")
        client = peer[0] if isinstance(peer, tuple) else "unix"
        try:
            first = b""
            while True:
                try:
                    request = await self.read_request(reader, writer, first)
                except Refusal as refusal:
                    await self.reply(writer, refusal)
                    await self.linger(reader, writer)
                    return
                if request is None or writer.transport.is_closing():
                    return  # the client left, or make_room closed this connection meanwhile
                self.waiting.pop(task, None)
                if not await self.forward(request, writer, client):
                    return
                self.waiting[task] = writer  # the newest of the waiting ones
                # keep-alive: the next request's first byte, or an idle close
                next_byte = asyncio.ensure_future(reader.readexactly(1))
                try:
                    if not await self.taken(writer, next_byte):
                        return
                    async with asyncio.timeout(self.limits.keepalive_timeout):
                        first = await next_byte
                except (TimeoutError, asyncio.IncompleteReadError):
                    return
                finally:
                    # also marks a failed read as seen (no "exception was never retrieved")
                    next_byte.cancel()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            writer.transport.abort()  # the client went away or stopped reading its answer
        finally:
            await self.close(writer)
            self.connections.pop(task, None)
            self.waiting.pop(task, None)

    async def taken(self, writer, next_byte: asyncio.Future) -> bool:
        """Wait until the client has taken all but ANSWER_BUFFER_BYTES of its answer; False (and
        the connection cut) when it takes nothing for MORPHO_FRONTEND_SEND_TIMEOUT. A look is
        due at the next poll, or as soon as `next_byte` (the next request's first byte) comes:
        a client that reads its answers before it asks again has taken this one by then."""
        transport = writer.transport
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family == socket.AF_UNIX:
            return True
        loop = asyncio.get_running_loop()
        fd, last, since, looks = sock.fileno(), -1, loop.time(), 0
        while not transport.is_closing():
            unsent = transport.get_write_buffer_size() + struct.unpack(
                "i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            if unsent <= ANSWER_BUFFER_BYTES:
                return True
            if unsent != last:
                last, since = unsent, loop.time()
            elif loop.time() - since >= self.limits.send_timeout:
                transport.abort()
                return False
            poll = TAKEN_POLL_S[min(looks, len(TAKEN_POLL_S) - 1)]
            if next_byte.done():
                await asyncio.sleep(poll)
            else:
                await asyncio.wait({next_byte}, timeout=poll)
            looks += 1
        return False

    async def close(self, writer) -> None:
        """Close after what is buffered has been sent; abort a client that does not take it."""
        writer.close()
        try:
            async with asyncio.timeout(self.limits.send_timeout):
                await writer.wait_closed()
        except (ConnectionError, asyncio.TimeoutError):
            writer.transport.abort()

    async def linger(self, reader, writer) -> None:
        """After an early answer, take in what the client still sends for a moment: a close with
        unread data resets the connection, and the reset can destroy the answer before the
        client has read it."""
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError, OSError):
            writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(CHUNK_BYTES):
                    pass

    async def read_request(self, reader, writer, first: bytes) -> Optional[Request]:
        """The whole request, head and body, within its deadlines; None if the client left."""
        limits = self.limits
        lines, size = [], 0
        try:
            async with asyncio.timeout(limits.header_timeout):
                while True:
                    try:
                        line = first if first == b"\n" else first + await reader.readuntil(b"\n")
                    except asyncio.LimitOverrunError:  # a line longer than gunicorn takes
                        check_line(None, len(lines))
                    first = b""
                    if line in (b"\r\n", b"\n"):
                        if lines:
                            break
                        continue  # an empty line before the request line is allowed
                    check_line(line, len(lines))
                    size += len(line)
                    if size > limits.max_header_bytes:
                        raise refuse(431, "headers", "headers_too_large",
                                     f"expected at most {limits.max_header_bytes} bytes of "
                                     f"request line and headers")
                    lines.append(line)
        except TimeoutError:
            raise refuse(408, "headers", "header_timeout",
                         f"expected the request line and headers within "
                         f"{limits.header_timeout:g} s") from None
        except asyncio.IncompleteReadError:
            return None
        method, target, version, headers = parse_head(lines)
        path = unquote(urlsplit(target.decode("latin-1")).path)
        length = declared_length(path, headers)
        request = Request(method, target, version, headers, length, Spool(SPOOL_MEMORY_BYTES))
        if not length:
            return request
        if version == b"HTTP/1.1" and any(v.lower() == b"100-continue"
                                          for v in request.values("expect")):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        deadline = limits.body_timeout + length / limits.body_min_rate
        try:
            async with asyncio.timeout(deadline):
                while request.body.written < length:
                    data = await reader.read(min(CHUNK_BYTES, length - request.body.written))
                    if not data:
                        return None
                    request.body.write(data)
        except TimeoutError:
            raise refuse(408, "body", "body_timeout",
                         f"expected {length} bytes within {deadline:.0f} s (at least "
                         f"{limits.body_min_rate} bytes/s), got {request.body.written}") from None
        return request

    def upstream_head(self, request: Request, client: str) -> bytes:
        """The request as gunicorn gets it: HTTP/1.0, so that its answer is never chunked (an
        answer without a length ends where gunicorn closes), and keep-alive, so that one with a
        length leaves the connection for the next request; X-Forwarded-For ends with the client."""
        named = {t.strip().decode("latin-1").lower() for v in request.values("connection")
                 for t in v.split(b",")}
        lines = [request.method + b" " + request.target + b" HTTP/1.0"]
        for lower, name, value in request.headers:
            if lower not in HOP_BY_HOP and lower not in FORWARDED and lower not in named:
                lines.append(name + b": " + value)
        forwarded = [v.strip() for v in request.values("x-forwarded-for") if v.strip()]
        lines.append(b"X-Forwarded-For: " + b", ".join(forwarded + [client.encode()]))
        lines.append(b"X-Forwarded-Proto: http")
        if request.length is not None:
            lines.append(b"Content-Length: %d" % request.length)
        lines.append(b"Connection: keep-alive")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def connect(self) -> tuple[asyncio.Transport, Upstream]:
        """A new connection to gunicorn; Refusal 503 when it takes none."""
        loop = asyncio.get_running_loop()
        protocol = Upstream(self.limits.max_header_bytes * 4)
        if self.upstream.startswith("unix:"):
            connecting = loop.create_unix_connection(lambda: protocol, self.upstream[5:])
        else:
            host, _, port = self.upstream.rpartition(":")
            connecting = loop.create_connection(lambda: protocol, host.strip("[]"), int(port))
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                transport, _ = await connecting
        except (OSError, asyncio.TimeoutError) as exc:
            if not self.upstream_down:
                log.warning("gunicorn at %s is not accepting connections: %r", self.upstream, exc)
            self.upstream_down = True
            raise refuse(503, "server", "unavailable",
                         "the web server of this party is not accepting connections (starting or "
                         "stopped); try again", {"Retry-After": str(RETRY_AFTER_S)}) from None
        if self.upstream_down:
            log.warning("gunicorn at %s accepts connections again", self.upstream)
            self.upstream_down = False
        return transport, protocol

    async def forward(self, request: Request, writer, client: str) -> bool:
        """Send the request to gunicorn, relay its answer; True if the connection stays open."""
        # the head and the body's start in one write: one packet for a query's request
        first = self.upstream_head(request, client) + request.body.read(CHUNK_BYTES)
        whole = not request.body.pending  # it can be sent again as it is
        upstream = self.pool.take() if whole else None
        timeout = self.limits.upstream_timeout
        try:
            try:
                while True:
                    kept = upstream is not None
                    if not kept:
                        upstream = (await self.connect())[1]
                    sending = await upstream.send(first, timeout)
                    while sending and (data := request.body.read(CHUNK_BYTES)):
                        sending = await upstream.send(data, timeout)
                    while not upstream.head_done and not upstream.closed:
                        await upstream.wait(timeout)
                    if upstream.head or not kept:
                        break
                    # a kept connection that gunicorn closed as the request went: it answered
                    # nothing, so the request goes again, whole, on a new connection
                    upstream.transport.abort()
                    upstream = None
                request.body.close()
            except asyncio.TimeoutError:
                await self.reply(writer, refuse(
                    504, "server", "timeout",
                    f"no answer from the web server of this party within {timeout:g} s"))
                return False
            except Refusal as refusal:
                await self.reply(writer, refusal)
                return False
            if not upstream.head_done or not STATUS_LINE.match(upstream.head):
                await self.reply(writer, refuse(
                    502, "server", "bad_gateway",
                    "the web server of this party closed the connection without a valid answer"))
                return False
            return await self.relay(request, upstream, writer)
        finally:
            request.body.close()
            if upstream is not None:
                self.pool.give(upstream)

    async def relay(self, request: Request, upstream: Upstream, writer) -> bool:
        """The answer to the client at the client's pace, with a length or chunked if it can."""
        lines = bytes(upstream.head).split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        status = int(status_line[1])
        headers = [line.partition(b":") for line in lines[1:] if line]
        length: Optional[int] = None
        kept = False  # gunicorn keeps the connection after this answer
        out = [b"HTTP/1.1 " + b" ".join(status_line[1:])]
        for name, _, value in headers:
            lower = name.strip().lower()
            if lower == b"content-length" and value.strip().isdigit():
                length = int(value.strip())
            elif lower == b"connection":
                kept = value.strip().lower() == b"keep-alive"
            elif lower.decode("latin-1") not in HOP_BY_HOP:
                out.append(name + b":" + value)
        bodiless = request.method == b"HEAD" or status in (204, 304) or 100 <= status < 200
        chunked = not bodiless and length is None and request.version == b"HTTP/1.1"
        keep = request.wants_keepalive() and (bodiless or length is not None or chunked)
        if length is not None:
            out.append(b"Content-Length: %d" % length)
        if chunked:
            out.append(b"Transfer-Encoding: chunked")
        out.append(b"Connection: keep-alive" if keep else b"Connection: close")
        # The head goes with the body's first bytes where they are there: one write, not two.
        head = b"\r\n".join(out) + b"\r\n\r\n"
        remaining = 0 if bodiless else length
        stalled = False
        while remaining is None or remaining > 0:
            data = upstream.read()
            if not data:
                if head:
                    await self.send(writer, head)
                    head = b""
                if upstream.closed:
                    break
                try:
                    await upstream.wait(self.limits.upstream_timeout)
                except asyncio.TimeoutError:
                    stalled = True
                    break
                continue
            if remaining is not None:
                data = data[:remaining]
                remaining -= len(data)
            await self.send(writer, head + (b"%x\r\n%s\r\n" % (len(data), data) if chunked
                                            else data))
            head = b""
        if head:
            await self.send(writer, head)
        if stalled or (remaining or 0) > 0 or (remaining is None and upstream.reset):
            # Cut short by gunicorn: end with a reset, never a clean end, so that no client takes
            # a part of an answer for the whole.
            log.warning("answer to %s %s cut short by gunicorn", request.method, request.target)
            writer.transport.abort()
            return False
        upstream.reusable = kept and (bodiless or length is not None)
        if chunked:
            await self.send(writer, b"0\r\n\r\n")
        return keep

    async def send(self, writer, data: bytes) -> None:
        if writer.transport.is_closing():  # closed by make_room or stop: the client is gone
            raise ConnectionResetError("the connection to the client was closed")
        writer.write(data)
        # what the kernel took at once needs no wait (nor a timer)
        if writer.transport.get_write_buffer_size() or writer.transport.is_closing():
            async with asyncio.timeout(self.limits.send_timeout):
                await writer.drain()

    async def reply(self, writer, refusal: Refusal) -> None:
        """The front end's own error answer; the connection is closed after it."""
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            await self.send(writer, refusal_bytes(refusal))


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


async def watch(procs: Processes, stop: asyncio.Event) -> None:
    """Stop the front end when one of its forked processes ends unasked."""
    while not procs.reap():
        await asyncio.sleep(CHILD_POLL_S)
    stop.set()


async def serve(sock: socket.socket, upstream: str, limits: Limits, procs: Processes) -> None:
    front = FrontEnd(upstream, limits)
    host, port = sock.getsockname()[:2]
    # The reader's limit is on one line: the longest gunicorn takes, with its CRLF.
    server = await asyncio.start_server(front.handle, sock=sock, backlog=1024,
                                        limit=MAX_FIELD_BYTES + 2)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)
    if procs.children:  # uvloop keeps SIGCHLD for itself: the forked processes are polled
        watching = asyncio.ensure_future(watch(procs, stop))
    if not procs.forked:
        log.info("front end on %s:%d (%d processes, at most %d connections each), forwarding "
                 "to %s", host, port, procs.count, limits.max_connections, upstream)
    await stop.wait()
    if procs.children:
        watching.cancel()
    procs.stop()
    server.close()
    await front.stop()
    if not procs.forked:
        log.info("front end on %s:%d stopped", host, port)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Buffering reverse proxy in front of gunicorn.")
    parser.add_argument("--listen", required=True, help="HOST:PORT the clients connect to")
    parser.add_argument("--upstream", required=True, help="gunicorn's HOST:PORT or unix:PATH")
    parser.add_argument("--processes", type=int, help="processes sharing the port (default: "
                        "MORPHO_FRONTEND_PROCESSES)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "morphoweb.settings")
    logging.basicConfig(level=settings.MORPHO_LOG_LEVEL,
                        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s")
    # Each open connection is a descriptor: let as many be open as the system allows this user.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    procs = Processes(args.processes or settings.MORPHO_FRONTEND_PROCESSES)
    host, port = _address(args.listen)
    sock = socket.create_server((host, port), backlog=1024)  # SO_REUSEADDR, as servers do
    limits = Limits.from_settings(procs.count)
    procs.fork()
    uvloop.run(serve(sock, args.upstream, limits, procs))
    return 0 if procs.forked else procs.wait()


if __name__ == "__main__":
    raise SystemExit(main())

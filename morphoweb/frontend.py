"""The front end of `make run`: an asyncio reverse proxy that reads each request whole first.

gunicorn gives each connection a thread from the moment it sends its first byte, so a few clients
that trickle their headers would hold every thread. Here a slow client costs a socket and a
coroutine: the head must arrive within MORPHO_FRONTEND_HEADER_TIMEOUT, the body (by its
Content-Length, spooled to a temporary file past 1 MiB) at a minimum rate, and only then is a
connection to gunicorn opened and the request sent at once, with the client's address in
X-Forwarded-For. The answer is read from gunicorn as fast as it comes (so its thread is free
again) and relayed to the client at the client's pace. Every error answered here is JSON in the
API's shape (detail, errors[{field, code, message}]).

    python -m morphoweb.frontend --listen 127.0.0.1:8001 --upstream unix:var/web-a.sock
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import resource
import signal
from dataclasses import dataclass
from typing import Optional
from urllib.parse import unquote, urlsplit

from django.conf import settings

from morphoweb.httphead import (
    MAX_FIELD_BYTES, Refusal, Request, check_line, declared_length, parse_head, refusal_bytes,
    refuse,
)
from morphoweb.spool import Spool

log = logging.getLogger("morphoweb.frontend")

SPOOL_MEMORY_BYTES = 1 << 20  # a body or answer beyond this goes to a temporary file
MAX_SPOOL_BYTES = 1 << 30  # an answer this far ahead of its slow reader pauses gunicorn's socket
CHUNK_BYTES = 64 * 1024
CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 2  # gunicorn not accepting connections: starting, restarting or stopped
SHUTDOWN_GRACE_S = 5.0  # requests in flight at SIGTERM get this long to finish
LINGER_S = 2.0  # after an early answer (408, 413, ...) what the client still sends is read so long
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

    @classmethod
    def from_settings(cls) -> "Limits":
        return cls(**{name: getattr(settings, f"MORPHO_FRONTEND_{name.upper()}")
                      for name in cls.__dataclass_fields__})


class Upstream(asyncio.Protocol):
    """One exchange with gunicorn: the request written with flow control, the answer read as
    fast as it comes into a spool (memory, then a temporary file), its head split off."""

    def __init__(self, max_head: int) -> None:
        self.max_head = max_head
        self.head = bytearray()
        self.head_done = False
        self.body = Spool(SPOOL_MEMORY_BYTES)
        self.closed = False  # gunicorn closed (or reset) the connection
        self.reset = False  # ... before it was done: the answer may be cut short
        self.changed = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.transport: Optional[asyncio.Transport] = None
        self.paused = False

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
        await asyncio.wait_for(self.writable.wait(), timeout)
        return not self.closed

    async def wait(self, timeout: float) -> None:
        """Until more of the answer (or the end) arrives; TimeoutError after `timeout` s."""
        self.changed.clear()
        await asyncio.wait_for(self.changed.wait(), timeout)

    def read(self) -> bytes:
        data = self.body.read(CHUNK_BYTES)
        if self.paused and self.body.pending < MAX_SPOOL_BYTES // 2:
            self.transport.resume_reading()
            self.paused = False
        return data


class FrontEnd:
    """Serves one listening socket, each request forwarded to `upstream` (HOST:PORT, unix:PATH)."""

    def __init__(self, upstream: str, limits: Limits) -> None:
        self.upstream, self.limits = upstream, limits
        self.upstream_down = False  # logged once per outage, not once per request
        self.connections: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def stop(self) -> None:
        """Let the requests in flight finish for a moment, then end every connection (each
        handler then returns by itself: asyncio's cancellation of them would log errors)."""
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=SHUTDOWN_GRACE_S)
        for writer in list(self.connections.values()):
            writer.transport.abort()
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=SHUTDOWN_GRACE_S)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections[asyncio.current_task()] = writer
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
                if request is None or not await self.forward(request, writer, client):
                    return
                try:  # keep-alive: the next request's first byte, or an idle close
                    first = await asyncio.wait_for(reader.readexactly(1),
                                                   self.limits.keepalive_timeout)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            writer.transport.abort()  # the client went away or stopped reading its answer
        finally:
            await self.close(writer)
            self.connections.pop(asyncio.current_task(), None)

    async def close(self, writer) -> None:
        """Close after what is buffered has been sent; abort a client that does not take it."""
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), self.limits.send_timeout)
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
        """The request as gunicorn gets it: HTTP/1.0 and Connection: close, so that its answer
        is never chunked and ends where gunicorn closes; X-Forwarded-For ends with the client."""
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
        lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def connect(self) -> tuple[asyncio.Transport, Upstream]:
        loop = asyncio.get_running_loop()
        protocol = Upstream(self.limits.max_header_bytes * 4)
        if self.upstream.startswith("unix:"):
            connecting = loop.create_unix_connection(lambda: protocol, self.upstream[5:])
        else:
            host, _, port = self.upstream.rpartition(":")
            connecting = loop.create_connection(lambda: protocol, host.strip("[]"), int(port))
        try:
            transport, _ = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
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
        try:
            transport, upstream = await self.connect()
        except Refusal as refusal:
            await self.reply(writer, refusal)
            return False
        timeout = self.limits.upstream_timeout
        try:
            try:
                sending = await upstream.send(self.upstream_head(request, client), timeout)
                while sending and (data := request.body.read(CHUNK_BYTES)):
                    sending = await upstream.send(data, timeout)
                request.body.close()
                while not upstream.head_done and not upstream.closed:
                    await upstream.wait(timeout)
            except asyncio.TimeoutError:
                await self.reply(writer, refuse(
                    504, "server", "timeout",
                    f"no answer from the web server of this party within {timeout:g} s"))
                return False
            if not upstream.head_done or not STATUS_LINE.match(upstream.head):
                await self.reply(writer, refuse(
                    502, "server", "bad_gateway",
                    "the web server of this party closed the connection without a valid answer"))
                return False
            return await self.relay(request, upstream, writer)
        finally:
            transport.abort()
            upstream.body.close()

    async def relay(self, request: Request, upstream: Upstream, writer) -> bool:
        """The answer to the client at the client's pace, with a length or chunked if it can."""
        lines = bytes(upstream.head).split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        status = int(status_line[1])
        headers = [line.partition(b":") for line in lines[1:] if line]
        length: Optional[int] = None
        out = [b"HTTP/1.1 " + b" ".join(status_line[1:])]
        for name, _, value in headers:
            lower = name.strip().lower()
            if lower == b"content-length" and value.strip().isdigit():
                length = int(value.strip())
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
        await self.send(writer, b"\r\n".join(out) + b"\r\n\r\n")
        remaining = 0 if bodiless else length
        stalled = False
        while remaining is None or remaining > 0:
            data = upstream.read()
            if not data:
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
            await self.send(writer, b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if stalled or (remaining or 0) > 0 or (remaining is None and upstream.reset):
            # Cut short by gunicorn: end with a reset, never a clean end, so that no client takes
            # a part of an answer for the whole.
            log.warning("answer to %s %s cut short by gunicorn", request.method, request.target)
            writer.transport.abort()
            return False
        if chunked:
            await self.send(writer, b"0\r\n\r\n")
        return keep

    async def send(self, writer, data: bytes) -> None:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), self.limits.send_timeout)

    async def reply(self, writer, refusal: Refusal) -> None:
        """The front end's own error answer; the connection is closed after it."""
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            await self.send(writer, refusal_bytes(refusal))


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve(listen: str, upstream: str, limits: Limits) -> None:
    front = FrontEnd(upstream, limits)
    host, port = _address(listen)
    # The reader's limit is on one line: the longest gunicorn takes, with its CRLF.
    server = await asyncio.start_server(front.handle, host, port, backlog=1024,
                                        limit=MAX_FIELD_BYTES + 2, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)
    log.info("front end on %s:%d, forwarding to %s", host, port, upstream)
    await stop.wait()
    server.close()
    await front.stop()
    log.info("front end on %s:%d stopped", host, port)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Buffering reverse proxy in front of gunicorn.")
    parser.add_argument("--listen", required=True, help="HOST:PORT the clients connect to")
    parser.add_argument("--upstream", required=True, help="gunicorn's HOST:PORT or unix:PATH")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "morphoweb.settings")
    logging.basicConfig(level=settings.MORPHO_LOG_LEVEL,
                        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s")
    # Each open connection is a descriptor: let as many be open as the system allows this user.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(serve(args.listen, args.upstream, Limits.from_settings()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

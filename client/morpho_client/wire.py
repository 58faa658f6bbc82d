"""The query path's HTTP/1.1: keep-alive connections to one party on asyncio streams.

The query requests carry up to 32 x 12,288 bytes of answers each, hundreds a second; httpx reads
such a body through several layers in 64 KiB steps and its pool walks every connection for each
request, which bound the whole client at a few thousand rows/s, and asyncio's streams copy it twice
and stop and start reading every 128 KiB. These connections have the kernel write each answer's
body into its own buffer and wake the request once; everything else (/epoch, /health, bulk jobs)
keeps httpx."""
from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from typing import Optional

from morpho_client.core import ServerError

MAX_HEAD_BYTES = 64 * 1024  # a response's status line and headers


class Headers(dict):
    """Response headers by lower-case name; get() takes any case, as httpx's do."""

    def get(self, name: str, default=None):
        return super().get(name.lower(), default)


class _Reply(asyncio.BufferedProtocol):
    """One keep-alive connection's reading side: the kernel copies each answer's body straight
    into a buffer of its Content-Length (recv_into), and the waiting request wakes once, when
    the answer is whole. An answer without a length (chunked, or up to the close) is gathered
    and decoded at the end."""

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.head = bytearray(MAX_HEAD_BYTES)
        self.filled = 0  # bytes of head received
        self.body: Optional[bytearray] = None  # the answer's body, Content-Length long
        self.got = 0  # bytes of body received
        self.framing = ""  # "length", "chunked" or "close", once the head is read
        self.status = 0
        self.headers = Headers()
        self.keep = False
        self.waiter: Optional[asyncio.Future] = None
        self.lost = False

    # -- asyncio's calls --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int):
        if self.framing == "length" and self.got < len(self.body):
            return memoryview(self.body)[self.got:]
        if self.framing == "length":
            # the answer is whole: asyncio asks for a buffer before it reads the party's close (or
            # bytes nobody asked for), and an empty one is a fatal error of the transport
            return memoryview(self.head)
        if self.framing and len(self.head) - self.filled < 65536:
            # chunked or up to the close: gathered at the end of head, which grows for it
            self.head.extend(bytes(max(65536, len(self.head))))
        return memoryview(self.head)[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.framing == "length":
            if self.got == len(self.body):  # bytes after a whole answer: not a connection to reuse
                self._fail(ValueError("bytes after the answer's Content-Length"))
                return
            self.got += nbytes
            if self.got == len(self.body):
                self._finish()
            return
        self.filled += nbytes
        if not self.framing:
            self._read_head()
        if self.framing == "chunked":
            self._try_chunked()

    def eof_received(self) -> bool:
        self.lost = True
        if self.framing == "close":
            self.body = self.head[self.end:self.filled]
            self.keep = False
            self._finish()
        else:
            self._fail(ConnectionResetError("the party closed the connection mid-answer"))
        return False

    def connection_lost(self, exc) -> None:
        self.lost = True
        self._fail(exc or ConnectionResetError("the connection closed"))

    # -- one answer ---------------------------------------------------------------------------
    def expect(self) -> asyncio.Future:
        """A future of the next answer's (status, headers, body, keep-alive)."""
        waiter = self.waiter = asyncio.get_running_loop().create_future()
        self.filled = self.got = 0
        self.body, self.framing = None, ""
        if len(self.head) > MAX_HEAD_BYTES:
            self.head = bytearray(MAX_HEAD_BYTES)
        if self.lost or (self.transport is not None and self.transport.is_closing()):
            # closed before the request was sent (a party at its limit closes new connections):
            # nothing will come on it, and a request written there would wait out the timeout
            self._fail(ConnectionResetError("the party closed the connection"))
        return waiter

    def _read_head(self) -> None:
        end = self.head.find(b"\r\n\r\n", 0, self.filled)
        if end < 0:
            if self.filled == len(self.head):
                self._fail(ValueError(f"a head over {MAX_HEAD_BYTES} bytes"))
            return
        lines = self.head[:end].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        try:
            if not version.startswith("HTTP/1."):
                raise ValueError(f"status line {lines[0][:80]!r}")
            self.status = int(rest.split(" ", 1)[0])
            headers = Headers()
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = headers.get("content-length")
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            length = None if chunked or length is None else int(length)
            if length is not None and length < 0:
                raise ValueError(f"Content-Length {length}")
        except ValueError as exc:
            self._fail(exc)
            return
        self.headers = headers
        self.keep = (headers.get("connection", "").lower() != "close" and version != "HTTP/1.0"
                     and (chunked or length is not None))
        self.end = end + 4
        if length is None:
            self.framing = "chunked" if chunked else "close"
            return
        extra = self.filled - self.end
        if extra > length:
            self._fail(ValueError("more bytes than the answer's Content-Length"))
            return
        self.body = bytearray(length)
        self.body[:extra] = self.head[self.end:self.filled]
        self.got, self.framing = extra, "length"
        if self.got == length:
            self._finish()

    def _try_chunked(self) -> None:
        """Decode the chunked body gathered so far; finish where its last chunk has come."""
        data, at, parts = self.head, self.end, []
        try:
            while True:
                line_end = data.find(b"\r\n", at, self.filled)
                if line_end < 0:
                    return
                size = int(bytes(data[at:line_end]).split(b";")[0], 16)
                at = line_end + 2
                if size == 0:
                    while True:  # trailers, then the blank line
                        line_end = data.find(b"\r\n", at, self.filled)
                        if line_end < 0:
                            return
                        blank, at = line_end == at, line_end + 2
                        if blank:
                            break
                    if at != self.filled:
                        raise ValueError("bytes after the chunked answer")
                    self.body = bytearray(b"".join(parts))
                    self._finish()
                    return
                if at + size + 2 > self.filled:
                    return
                parts.append(data[at:at + size])
                at += size + 2
        except ValueError as exc:
            self._fail(exc)

    def _finish(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.status, self.headers, self.body, self.keep))
        elif waiter is None:  # bytes nobody asked for: this connection is not reused
            self.keep = False

    def _fail(self, exc: BaseException) -> None:
        self.keep = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class Connection:
    def __init__(self, transport: asyncio.Transport, reply: _Reply) -> None:
        self.transport, self.reply = transport, reply

    def close(self) -> None:
        self.transport.close()


class PartyPool:
    """Keep-alive connections to one party: at most `size` open, each carrying one request at a
    time; a connection the party closed while idle is replaced and the request sent again."""

    def __init__(self, base: str, size: int, timeout: float) -> None:
        parts = urllib.parse.urlsplit(base)
        self.base = base
        self.https = parts.scheme.lower() == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self._idle: list[Connection] = []
        self._slots = asyncio.Semaphore(size)
        self._ssl = ssl.create_default_context() if self.https else None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        transport, reply = await loop.create_connection(_Reply, self.host, self.port,
                                                        ssl=self._ssl)
        return Connection(transport, reply)

    async def post(self, path: str, body: bytes, content_type: str, accept: str,
                   headers: Optional[dict] = None):
        """(status, headers, body) of one POST (`headers` added to its own); ServerError where
        the party cannot be reached or does not answer within the timeout. The body is a
        bytearray of the answer alone, the caller's to keep."""
        url = self.base + path
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: {content_type}\r\nAccept: {accept}\r\n{extra}"
                f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        async with self._slots:
            for attempt in range(2):
                conn = None
                while self._idle and conn is None:
                    conn = self._idle.pop()
                    if conn.reply.lost or conn.transport.is_closing():
                        conn.close()  # the party closed it while idle
                        conn = None
                reused = conn is not None
                try:
                    if conn is None:
                        conn = await asyncio.wait_for(self._connect(), self.timeout)
                except asyncio.TimeoutError:
                    raise ServerError(f"{url}: no connection within {self.timeout:g} s") from None
                except OSError as exc:
                    raise ServerError(f"{url}: cannot reach the server ({exc})") from None
                try:
                    answer = conn.reply.expect()
                    conn.transport.write(head + body)
                    status, headers, payload, keep = await asyncio.wait_for(answer, self.timeout)
                except asyncio.TimeoutError:
                    conn.close()
                    raise ServerError(f"{url}: no answer within {self.timeout:g} s "
                                      "(--timeout)") from None
                except (ConnectionError, OSError) as exc:
                    conn.close()
                    if reused and attempt == 0:
                        continue  # the party closed it while idle: a fresh connection
                    raise ServerError(f"{url}: the connection broke ({exc!r})") from None
                except ValueError as exc:
                    conn.close()
                    raise ServerError(f"{url}: not an HTTP/1.1 answer ({exc})") from None
                except BaseException:  # cancelled: its answer may still come, on no one's request
                    conn.close()
                    raise
                if keep:
                    self._idle.append(conn)
                else:
                    conn.close()
                return status, headers, payload
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

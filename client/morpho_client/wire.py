"""The query path's HTTP/1.1: keep-alive connections to one party on asyncio streams.

The query requests carry up to 32 x 12,288 bytes of answers each, hundreds a second; httpx reads
such a body through several layers in 64 KiB steps and its pool walks every connection for each
request, which bound the whole client at a few thousand rows/s. These connections send a request
and read its answer with two buffered reads; everything else (/epoch, /health, bulk jobs) keeps
httpx."""
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


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


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
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self._ssl,
                                                       limit=MAX_HEAD_BYTES)
        return Connection(reader, writer)

    async def post(self, path: str, body: bytes, content_type: str, accept: str,
                   headers: Optional[dict] = None):
        """(status, headers, body) of one POST (`headers` added to its own); ServerError where
        the party cannot be reached or does not answer within the timeout."""
        url = self.base + path
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: {content_type}\r\nAccept: {accept}\r\n{extra}"
                f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        async with self._slots:
            for attempt in range(2):
                reused = bool(self._idle)
                try:
                    conn = self._idle.pop() if reused else await asyncio.wait_for(
                        self._connect(), self.timeout)
                except asyncio.TimeoutError:
                    raise ServerError(f"{url}: no connection within {self.timeout:g} s") from None
                except OSError as exc:
                    raise ServerError(f"{url}: cannot reach the server ({exc})") from None
                try:
                    conn.writer.write(head + body)
                    status, headers, payload, keep = await asyncio.wait_for(
                        self._read(conn), self.timeout)
                except asyncio.TimeoutError:
                    conn.close()
                    raise ServerError(f"{url}: no answer within {self.timeout:g} s "
                                      "(--timeout)") from None
                except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
                    conn.close()
                    if reused and attempt == 0:
                        continue  # the party closed it while idle: a fresh connection
                    raise ServerError(f"{url}: the connection broke ({exc!r})") from None
                except ValueError as exc:
                    conn.close()
                    raise ServerError(f"{url}: not an HTTP/1.1 answer ({exc})") from None
                if keep:
                    self._idle.append(conn)
                else:
                    conn.close()
                return status, headers, payload
        raise AssertionError("unreachable")

    async def _read(self, conn: Connection):
        raw = await conn.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"status line {lines[0][:80]!r}")
        status = int(rest.split(" ", 1)[0])
        headers = Headers()
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            payload = await _chunked(conn.reader)
            keep = True
        elif headers.get("content-length") is not None:
            payload = await conn.reader.readexactly(int(headers["content-length"]))
            keep = True
        else:
            payload = await conn.reader.read()  # until the party closes the connection
            keep = False
        keep = keep and headers.get("connection", "").lower() != "close" and version != "HTTP/1.0"
        return status, headers, payload, keep

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)

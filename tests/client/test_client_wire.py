"""The query path's own HTTP/1.1 (morpho_client.wire) against a raw server: answers with a length,
chunked or up to the close, in pieces of any size, and connections the server closed while idle."""
from __future__ import annotations

import asyncio

import pytest

from morpho_client.core import ServerError
from morpho_client.wire import PartyPool

BODY = bytes(range(256)) * 1536  # 393,216 bytes: a 32-query binary answer


def answer(framing: str, body: bytes, status: int = 200) -> list[bytes]:
    """The answer's bytes, as pieces written one at a time."""
    head = f"HTTP/1.1 {status} OK\r\nContent-Type: application/octet-stream\r\nX-Morpho-Epoch-Id: 7\r\n"
    if framing == "length":
        return [(head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body[:5], body[5:]]
    if framing == "chunked":
        chunks = [body[i:i + 100_000] for i in range(0, len(body), 100_000)]
        out = [(head + "Transfer-Encoding: chunked\r\n\r\n").encode()]
        for chunk in chunks:
            out += [f"{len(chunk):x};ext=1\r\n".encode(), chunk, b"\r\n"]
        return out + [b"0\r\nX-Trailer: 1\r\n\r\n"]
    return [(head + "Connection: close\r\n\r\n").encode(), body]  # up to the close


async def serve(plan):
    """A server answering each request with the next (framing, close after) of `plan`."""
    requests = []

    async def handle(reader, writer):
        try:
            while plan:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                requests.append((head, await reader.readexactly(length)))
                framing, close = plan.pop(0)
                for piece in answer(framing, BODY):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                if close or framing == "close":
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", requests


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_each_framing_reads_the_whole_body(framing):
    async def run():
        server, url, requests = await serve([(framing, False), (framing, False)])
        pool = PartyPool(url, 2, timeout=30)
        try:
            for _ in range(2):
                status, headers, payload = await pool.post("/q", b"keys", "a/b", "a/b",
                                                           {"X-Extra": "1"})
                assert (status, headers.get("X-Morpho-Epoch-Id"), bytes(payload)) == (200, "7", BODY)
        finally:
            pool.close()
            server.close()
        assert len(requests) == 2 and requests[0][1] == b"keys"
        assert b"X-Extra: 1\r\n" in requests[0][0]
    asyncio.run(run())


def test_a_connection_closed_while_idle_is_replaced():
    async def run():
        # the server closes after each answer although it said nothing of it
        errors = []  # asyncio's reports of transport errors, which a close while idle is not
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        server, url, requests = await serve([("length", True), ("length", True), ("length", True)])
        pool = PartyPool(url, 1, timeout=30)
        try:
            for _ in range(3):
                await asyncio.sleep(0.05)  # the close reaches the idle connection first
                assert bytes((await pool.post("/q", b"k", "a/b", "a/b"))[2]) == BODY
        finally:
            pool.close()
            server.close()
        assert len(requests) == 3
        assert [context["message"] for context in errors] == []
    asyncio.run(run())


def test_an_answer_cut_short_is_an_error_naming_the_url():
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = PartyPool(url, 1, timeout=30)
        try:
            with pytest.raises(ServerError, match=f"{url}/q: the connection broke"):
                await pool.post("/q", b"", "a/b", "a/b")
        finally:
            pool.close()
            server.close()
    asyncio.run(run())


def test_a_request_cancelled_mid_answer_closes_its_connection():
    closed = asyncio.Event()

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # no answer: waits until the client closes the connection
        closed.set()
        writer.close()

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = PartyPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", 1, timeout=30)
        try:
            request = asyncio.ensure_future(pool.post("/q", b"", "a/b", "a/b"))
            await asyncio.sleep(0.2)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            # its answer could still come on it: the connection is closed, not left open
            await asyncio.wait_for(closed.wait(), 5)
        finally:
            pool.close()
            server.close()
    asyncio.run(run())


def test_a_new_connection_the_party_closed_at_once_fails_without_waiting():
    async def handle(reader, writer):
        writer.close()  # accepted and closed before any request, as a party at its limit may

    class SlowToHandOver(PartyPool):
        async def _connect(self):
            conn = await super()._connect()
            await asyncio.sleep(0.2)  # the party's close arrives before the request is sent
            return conn

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = SlowToHandOver(url, 1, timeout=10)
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(ServerError, match=f"{url}/q: the connection broke"):
                await pool.post("/q", b"", "a/b", "a/b")
            assert asyncio.get_running_loop().time() - started < 5  # not the whole timeout
        finally:
            pool.close()
            server.close()
    asyncio.run(run())

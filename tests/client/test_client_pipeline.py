"""The client's pipelining against stand-in parties (httpx transports): requests kept in flight,
keys planned a window at a time, rows yielded as they come in flat memory, retries bounded."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import threading
import time
import tracemalloc

import httpx
import numpy as np
import pytest

from morpho_client import AsyncPirClient, EpochMismatch, PirClient
from morpho_client import aio as aio_module
from morpho_client.aio import in_flight_for
from morpho_client.plan import choose_pages_many
from morpho_pir.dpf import key_length
from morpho_pir.http import ANSWER_BYTES, EPOCH_HEADER, OCTET_STREAM

PAGES = 64  # domain_bits 6: keys are cheap, so the client's own work is what is measured
ROWS = PAGES * 16


class FakeParty:
    """Answers /epoch, /health and binary batch queries at once (zero pages), counting how many
    of its requests are in flight; `epochs` maps a request number to the epoch it names."""

    def __init__(self, pass_queries: int = 64, epochs=None, delay: float = 0.002) -> None:
        self.pass_queries, self.epochs, self.delay = pass_queries, epochs or {}, delay
        self.in_flight = self.most_in_flight = self.requests = 0
        self.queries = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/epoch":
            return httpx.Response(200, json={
                "epoch_id": 1, "num_rows": ROWS, "block_number": 0, "state_root": "0x" + "00" * 32,
                "encodings": ["json", "binary"], "key_formats": ["v1", "v2"],
                "page_pir": {"domain_bits": 6, "rows_per_page": 16, "num_pages": PAGES,
                             "page_size_bytes": 4096}})
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "pass_queries": self.pass_queries})
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)  # the party's work: others arrive meanwhile
            body = await request.aread()
            queries = len(body) // (3 * key_length(6, 2))
            self.queries += queries
            epoch = self.epochs.get(self.requests, 1)
            self.requests += 1
            return httpx.Response(200, content=bytes(queries * ANSWER_BYTES), headers={
                "Content-Type": OCTET_STREAM, EPOCH_HEADER: str(epoch),
                "X-Morpho-State-Updates": "0", "X-Morpho-State-Digest": "0x" + "00" * 32})
        finally:
            self.in_flight -= 1


class BusyParty(FakeParty):
    """A party that starts one request at a time, each `delay` s, and answers 503 with
    Retry-After to one not started within `queue_timeout` s, as the engine's queue timeout does."""

    def __init__(self, queue_timeout: float, **options) -> None:
        super().__init__(**options)
        self.queue_timeout, self.refused, self.turn = queue_timeout, 0, None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/epoch", "/health"):
            return await super().__call__(request)
        self.turn = self.turn or asyncio.Lock()
        try:
            await asyncio.wait_for(self.turn.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            self.refused += 1
            return httpx.Response(503, headers={"Retry-After": "0"}, json={
                "detail": "interactive query not started within the queue timeout"})
        try:
            return await super().__call__(request)
        finally:
            self.turn.release()


def client_of(party_a, party_b, **options) -> AsyncPirClient:
    async def route(request: httpx.Request):
        return await (party_a if request.url.host == "a.test" else party_b)(request)
    return AsyncPirClient("http://a.test", "http://b.test", key_format="v2",
                          transport=httpx.MockTransport(route), **options)


def test_requests_are_kept_in_flight_at_each_party():
    parties = FakeParty(), FakeParty()

    async def run():
        async with client_of(*parties, in_flight=6) as client:
            return await client.fetch_rows([i % ROWS for i in range(32 * 40)])
    got = asyncio.run(run())
    assert len(got) == 32 * 40 and got[0] == bytes(256)
    for party in parties:
        assert party.requests == 40 and party.queries == 32 * 40
        assert party.most_in_flight == 6  # not one at a time, and never more than asked


def test_the_window_follows_the_parties_pass_size():
    assert in_flight_for({"pass_queries": 74}, 32) == 6  # two launches of 74 in 32-query requests
    assert in_flight_for({"pass_queries": 8}, 32) == 4
    assert in_flight_for({}, 32) == aio_module.DEFAULT_IN_FLIGHT
    parties = FakeParty(pass_queries=128), FakeParty(pass_queries=74)

    async def run():
        async with client_of(*parties) as client:
            await client.fetch_rows(range(32 * 20))
            return client.in_flight
    assert asyncio.run(run()) == 6  # the fewer of the two parties'
    assert max(p.most_in_flight for p in parties) == 6


def test_a_fetch_after_a_single_request_keeps_its_whole_window_in_flight():
    """The client's first request, of pages it picked, comes before in_flight is chosen from
    /health; the fetch after it still keeps the parties' window (16 here) in flight."""
    parties = FakeParty(pass_queries=256), FakeParty(pass_queries=256)

    async def run():
        async with client_of(*parties) as client:
            await client.fetch_pages([0])
            await client.fetch_rows([i % ROWS for i in range(32 * 40)])
            return client.in_flight
    assert asyncio.run(run()) == 16
    assert [p.most_in_flight for p in parties] == [16, 16]


def test_keys_are_made_a_window_at_a_time(monkeypatch):
    calls = []
    real = aio_module.plan_window

    def counting(rows, *args, **kwargs):
        calls.append(len(rows))
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(aio_module, "plan_window", counting)

    async def run():
        # planners=0: in this process, where the count is taken (processes make the same calls)
        async with client_of(FakeParty(), FakeParty(), in_flight=4, planners=0) as client:
            await client.fetch_rows(range(1000))
    asyncio.run(run())
    assert calls == [128] * 7 + [104]  # 4 requests of 32 queries a window, not 32 rows a call


def test_iter_rows_holds_flat_memory_over_a_generator():
    """Rows from a generator, yielded as they come: what is held does not grow with the count."""
    def rows(count):
        return (i % ROWS for i in range(count))

    def peak_after(count: int) -> int:
        gc.collect()
        tracemalloc.start()
        seen = 0
        with PirClient("http://a.test", "http://b.test", key_format="v2", in_flight=8,
                       planners=0, transport=httpx.MockTransport(_route)) as client:
            for row, data in client.iter_rows(rows(count)):
                seen += 1
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert seen == count
        return peak

    small, large = peak_after(4_000), peak_after(40_000)
    # ten times the rows, the same memory: a window of keys and in-flight answers (8 requests of
    # 32 queries, 12 KiB of answer each per party), never the rows fetched so far
    assert large < 1.3 * small and large < 40 * 2**20, (small, large)


_parties = (FakeParty(delay=0), FakeParty(delay=0))


async def _route(request: httpx.Request):
    return await _parties[request.url.host != "a.test"](request)


def test_an_epoch_switch_is_waited_out_never_mixed():
    # B names epoch 2 in its first three answers (it switched first), then 1 again.
    parties = FakeParty(), FakeParty(epochs={0: 2, 1: 2, 2: 2})

    async def run(deadline):
        async with client_of(*parties, in_flight=1, switch_deadline=deadline) as client:
            return await client.fetch_rows(range(64))
    assert len(asyncio.run(run(5.0))) == 64
    assert parties[1].requests == 2 + 3  # the first request three more times, then the second
    parties = FakeParty(), FakeParty(epochs={i: 2 for i in range(1000)})
    with pytest.raises(EpochMismatch, match="answered from different epochs: 1 and 2"):
        asyncio.run(run(0.3))


def test_planner_processes_make_the_same_fetch():
    parties = FakeParty(), FakeParty()

    async def run():
        async with client_of(*parties, in_flight=2, planners=2) as client:
            got = await client.fetch_rows([i % ROWS for i in range(640)])
            assert client._planners_pool is not None  # ten windows: planned in processes
            return got
    assert len(asyncio.run(run())) == 640
    assert [p.queries for p in parties] == [640, 640]


def test_decoys_are_distinct_and_the_slot_uniform():
    pages = np.arange(3000) % 50
    chosen, slots = choose_pages_many(pages, 50)
    assert (chosen[np.arange(3000), slots] == pages).all()
    assert all(len(set(row)) == 3 for row in chosen.tolist())
    assert ((chosen >= 0) & (chosen < 50)).all()
    counts = np.bincount(slots, minlength=3)
    assert counts.min() > 850  # 1,000 each expected
    with pytest.raises(ValueError, match=r"page 50 is outside \[0, 50\)"):
        choose_pages_many(np.array([50]), 50)
    assert json.dumps(choose_pages_many(np.array([0, 1]), 2)[0].tolist())  # two pages: repeats


@pytest.mark.parametrize("fetch", [lambda client: client.fetch_rows(range(64)),
                                   lambda client: list(client.iter_rows(range(64)))],
                         ids=["fetch_rows", "iter_rows"])
def test_ctrl_c_in_a_blocking_fetch_cancels_its_requests(fetch):
    parties = FakeParty(delay=60), FakeParty(delay=60)  # answers that do not come in time

    async def route(request: httpx.Request):
        return await parties[request.url.host != "a.test"](request)

    def interrupt_when_sent():
        deadline = time.monotonic() + 30
        while parties[0].in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the main thread waits for the fetch

    client = PirClient("http://a.test", "http://b.test", key_format="v2", in_flight=2,
                       planners=0, transport=httpx.MockTransport(route))
    try:
        threading.Thread(target=interrupt_when_sent, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):  # itself, not an error of closing the iterator
            fetch(client)
        deadline = time.monotonic() + 5
        while any(p.in_flight for p in parties):  # the fetch ends in the loop too
            assert time.monotonic() < deadline, "the fetch went on after Ctrl-C"
            time.sleep(0.01)
    finally:
        client.close()


def test_a_busy_party_shrinks_the_requests_in_flight_until_they_start():
    """32 in flight against parties that start a request within 2.5 requests' time: the client
    halves what it sends at each refusal and grows it back by one a window, so the fetch ends
    with every row and a few dozen refusals a party; sending 32 again at each retry met about
    200 and, with a deadline of 0.6 s, failed."""
    parties = BusyParty(0.05, delay=0.02), BusyParty(0.05, delay=0.02)

    async def run():
        async with client_of(*parties, in_flight=32, switch_deadline=5) as client:
            got = await client.fetch_rows([i % ROWS for i in range(32 * 60)])
            return got, client._gate
    got, gate = asyncio.run(run())
    assert len(got) == 32 * 60 and all(row == bytes(256) for row in got)
    assert [party.requests for party in parties] == [60, 60]
    assert all(party.refused < 100 for party in parties), [p.refused for p in parties]
    assert 1 <= gate.size < 32 and gate.busy == 0


def test_the_congestion_window_halves_what_was_queued_and_grows_one_a_window():
    gate = aio_module.Congestion(8)
    gate.busy = 5
    gate.refused()  # six were in the queue, this one among them
    assert gate.size == 3.0
    gate.busy = 0
    for _ in range(3):
        gate.answered()
    assert 3.9 < gate.size < 4.0  # one window of answers: one more
    for _ in range(100):
        gate.answered()
    assert gate.size == 8.0  # never past what was asked
    gate.refused()
    gate.refused()
    gate.refused()
    gate.refused()
    assert gate.size == 1.0  # never below one

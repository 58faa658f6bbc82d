"""The asyncio PIR client: batch requests kept in flight to both parties over keep-alive pools."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import time
from typing import AsyncIterator, Iterable, Optional, Sequence

import httpx
import numpy as np

from morpho_pir.dpf import format_by_name
from morpho_pir.http import BATCH_PATH, OCTET_STREAM, QUERY_PATH
from morpho_pir.protocol import MAX_BATCH_QUERIES, ROWS_PER_PAGE

from morpho_client.bulk import BulkJobs
from morpho_client.core import (ENCODINGS, KEY_FORMATS, Answer, EpochInfo, EpochMismatch, Half,
                                ServerError, agreed_epoch, binary_half, check_distinct_servers,
                                choose_key_format, combine, error_from, json_half)
from morpho_client.lookup import Lookups
from morpho_client.plan import Window, plan_window
from morpho_client.planners import Planners, auto_planners, check_planners
from morpho_client.wire import PartyPool

# Default seconds a fetch keeps retrying while the parties are out of step (an epoch switch, a
# row update one party took first) or busy (503 with Retry-After), before it gives up.
SWITCH_DEADLINE_S = 30.0
FIRST_RETRY_S = 0.1  # pause before the first retry, doubled up to MAX_RETRY_S
MAX_RETRY_S = 2.0
DEFAULT_IN_FLIGHT = 8  # requests per party where /health names no pass size
MAX_IN_FLIGHT = 64
RETRIED_STATUSES = (429, 503)
JSON = "application/json"


class Congestion:
    """How many query requests of a client are at the parties at once: up to `limit`, halved
    when a party answers busy (503 or 429: a request not started within its queue timeout), and
    grown back by one a window of answers, as TCP's congestion window is. A client that asks
    for more in flight than a party starts within its queue timeout settles on what it does,
    instead of retrying into the same queue until its deadline."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = float(limit)
        self.busy = 0  # requests at the parties
        self._waiters: list = []

    @contextlib.asynccontextmanager
    async def slot(self):
        """Held while a request is at the parties; yields the seconds it waited for it."""
        began = time.monotonic()
        while self.busy >= int(self.size):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.busy += 1
        try:
            yield time.monotonic() - began
        finally:
            self.busy -= 1
            for waiter in self._waiters:  # each looks again; at most `limit` wait
                if not waiter.done():
                    waiter.set_result(None)
            self._waiters.clear()

    def answered(self) -> None:
        self.size = min(float(self.limit), self.size + 1.0 / self.size)

    def refused(self) -> None:
        """A party was busy: half the requests that were in its queue with this one."""
        self.size = max(1.0, min(self.size, self.busy + 1) / 2)


def in_flight_for(health: dict, batch: int) -> int:
    """Requests to keep in flight at each party: two launches' worth of `batch`-query requests
    where /health names the engine's pass size (a launch holds at most one pass), else
    DEFAULT_IN_FLIGHT; one launch fills while the other runs."""
    pass_queries = health.get("pass_queries") if isinstance(health, dict) else None
    if not isinstance(pass_queries, int) or pass_queries <= 0:
        return DEFAULT_IN_FLIGHT
    return max(4, min(MAX_IN_FLIGHT, 2 * -(-pass_queries // batch)))


class AsyncPirClient(BulkJobs, Lookups):
    """Fetches rows from two non-colluding parties; each sees only pseudorandom keys.

    `in_flight` batch requests are kept in flight at each party (None: chosen from the parties'
    /health), the keys of the next window of requests made while the earlier ones are answered.
    Answers are XORed only where both parties name one epoch and served state; while they differ
    the request is sent again until `switch_deadline` seconds have passed.

    `planners` key-making processes (morpho_client.planners) make the keys of a fetch of several
    windows beside the event loop: None, auto_planners() (two, fewer on a host of under three
    cores); 0, a thread of this process."""

    def __init__(self, server_a: str, server_b: str, timeout: float = 120.0,
                 max_batch: int = MAX_BATCH_QUERIES, encoding: str = "auto",
                 key_format: str = "auto", in_flight: Optional[int] = None,
                 switch_deadline: float = SWITCH_DEADLINE_S,
                 transport: Optional[httpx.AsyncBaseTransport] = None,
                 planners: Optional[int] = None) -> None:
        if not 1 <= max_batch <= MAX_BATCH_QUERIES:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH_QUERIES}, got {max_batch}")
        check_distinct_servers(server_a, server_b)
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        if key_format not in KEY_FORMATS:
            raise ValueError(f"key_format must be one of {', '.join(KEY_FORMATS)}, got {key_format!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds above 0, got {timeout!r}")
        if in_flight is not None and not 1 <= in_flight <= MAX_IN_FLIGHT:
            raise ValueError(f"in_flight must be in 1..{MAX_IN_FLIGHT}, got {in_flight}")
        self.planners = check_planners(planners)
        if not switch_deadline >= 0:
            raise ValueError(f"switch_deadline must be 0 or more seconds, got {switch_deadline!r}")
        self.servers = (server_a.rstrip("/"), server_b.rstrip("/"))
        self.timeout = timeout
        self.max_batch = max_batch
        self.encoding = encoding
        self.key_format = key_format
        self.in_flight = in_flight
        self.switch_deadline = switch_deadline
        self.last_key_format: Optional[str] = None  # the format of the last fetch's keys
        self._advertised: tuple = (("json",), ("json",))  # per party, from its /epoch
        self._key_formats: tuple = (("v1",), ("v1",))  # per party, from its /epoch
        self._used: list = [None, None]  # per party, the encoding of its last query request
        self._planners_pool: Optional[Planners] = None  # started by the first long fetch
        self._transport = transport  # httpx's own (None: its connection pool over TCP)
        self._http: Optional[httpx.AsyncClient] = None
        self._wire: list = [None, None]  # each party's query connections (wire.PartyPool)
        self._shape: tuple = (0, 0)  # (num_pages, domain_bits) the fetch's keys were made for
        self._gate: Optional[Congestion] = None  # made with the first query request

    # -- transport ----------------------------------------------------------------------------
    @property
    def http(self) -> httpx.AsyncClient:
        """httpx's keep-alive pool: /epoch, /health, bulk jobs, and the queries where a
        transport was given (made on first use, in the loop)."""
        if self._http is None:
            limits = httpx.Limits(max_connections=2 * MAX_IN_FLIGHT + 8,
                                  max_keepalive_connections=2 * MAX_IN_FLIGHT + 8)
            self._http = httpx.AsyncClient(timeout=self.timeout, limits=limits,
                                           transport=self._transport)
        return self._http

    async def request(self, method: str, url: str, **kwargs) -> httpx.Response:
        """One request, read whole; an error status or an unreachable server is a ServerError."""
        try:
            response = await self.http.request(method, url, **kwargs)
        except httpx.TimeoutException:
            raise ServerError(f"{url}: no answer within {self.timeout:g} s (--timeout)") from None
        except httpx.HTTPError as exc:
            raise ServerError(f"{url}: cannot reach the server ({exc})") from None
        if response.status_code >= 400:
            raise error_from(url, response.status_code, response.text, response.headers)
        return response

    async def get_json(self, base: str, path: str, body: Optional[dict] = None):
        """(parsed JSON, headers) of a GET, or of a POST of `body`."""
        url = base + path
        response = await self.request("GET" if body is None else "POST", url,
                                      json=body, headers={"Accept": JSON})
        try:
            return response.json(), response.headers
        except ValueError:
            raise ServerError(f"{url}: the response is not JSON") from None

    async def _both(self, *calls):
        """Both parties' calls at once; where one fails the other is cancelled, not orphaned."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # -- protocol -----------------------------------------------------------------------------
    async def epoch(self) -> EpochInfo:
        """The epoch both parties serve; EpochMismatch if they differ in id or shape."""
        bodies = await self._both(*(self.get_json(base, "/epoch") for base in self.servers))
        infos = [EpochInfo.from_json(body, base) for (body, _), base in zip(bodies, self.servers)]
        self._advertised = tuple(info.encodings for info in infos)
        self._key_formats = tuple(info.key_formats for info in infos)
        return agreed_epoch(self.servers, infos)

    async def settled_epoch(self) -> EpochInfo:
        """epoch(), retried while the parties are out of step, up to switch_deadline."""
        return await self._retrying(self.epoch)

    async def health(self) -> list[dict]:
        """Both parties' /health bodies (a 503 body too: it says why)."""
        async def one(base):
            try:
                return (await self.get_json(base, "/health"))[0]
            except ServerError as exc:
                try:
                    return json.loads(exc.body or "")
                except ValueError:
                    return {}
        return await self._both(*(one(base) for base in self.servers))

    async def requests_in_flight(self) -> int:
        """`in_flight`, or where None, the fewer of the two parties' in_flight_for."""
        if self.in_flight is None:
            self.in_flight = min(in_flight_for(h, self.max_batch) for h in await self.health())
        return self.in_flight

    def key_format_for(self, info: EpochInfo) -> str:
        """"v1" or "v2": the forced format, else v2 where both parties' /epoch list it."""
        return choose_key_format(self.key_format, self.servers, self._key_formats)

    @property
    def last_encodings(self) -> tuple:
        """(party A's, party B's) encoding of the last query request; None before any."""
        return tuple(self._used)

    def encoding_for(self, side: int) -> str:
        """"json" or "binary": the forced encoding, else binary where the party advertises it."""
        if self.encoding != "auto":
            return self.encoding
        return "binary" if "binary" in self._advertised[side] else "json"

    def plan(self, info: EpochInfo, rows, pages=None) -> Window:
        """Keys for `rows` (or for `pages`, one per row) in the fetch's key format."""
        return plan_window(rows, info.num_pages, info.domain_bits,
                           format_by_name(self.key_format_for(info)), pages)

    async def _ask_party(self, side: int, window: Window, first: int, last: int,
                         batch: bool) -> Half:
        """Party `side`'s answer to queries [first, last) of `window`, in its encoding."""
        path = BATCH_PATH if batch else QUERY_PATH
        url = self.servers[side] + path
        slots = window.slots[first:last]
        encoding = self.encoding_for(side)
        self._used[side] = encoding
        if encoding == "binary":
            headers, payload = await self._post(side, path, window.body(side, first, last),
                                                OCTET_STREAM)
            return binary_half(url, headers, payload, slots)
        queries = window.hex_queries(side, first, last)
        body = {"queries": [{"keys": q} for q in queries]} if batch else {"keys": queries[0]}
        headers, payload = await self._post(side, path, json.dumps(body).encode(), JSON)
        try:
            reply = json.loads(payload)
        except ValueError:
            raise ServerError(f"{url}: the response is not JSON") from None
        return json_half(url, headers, reply, slots, batch)

    async def _post(self, side: int, path: str, body: bytes, media: str,
                    headers: Optional[dict] = None):
        """(headers, body) of a query request to party `side` (`headers` added): on the
        party's own keep-alive connections (wire.PartyPool), or through httpx where a
        transport was given."""
        url = self.servers[side] + path
        if self._transport is not None:
            response = await self.request("POST", url, content=body, headers={
                **(headers or {}), "Content-Type": media, "Accept": media})
            return response.headers, response.content
        if self._wire[side] is None:
            self._wire[side] = PartyPool(self.servers[side], self.in_flight or DEFAULT_IN_FLIGHT,
                                         self.timeout)
        status, answered, payload = await self._wire[side].post(path, body, media, media, headers)
        if status >= 400:
            raise error_from(url, status, payload.decode("utf-8", "replace"), answered)
        return answered, payload

    async def ask(self, window: Window, first: int = 0, last: Optional[int] = None,
                  batch: bool = True) -> Answer:
        """Queries [first, last) of `window` (at most max_batch) sent to both parties at once,
        their answers XORed: the wanted pages, with the epoch and state both answered from.

        Retried while the parties answer from different epochs or states, or are busy, up to
        switch_deadline; the keys stay the same (a party sees nothing new), and where the
        parties' shape changed the keys cannot be answered: EpochMismatch."""
        last = len(window) if last is None else last
        if not 0 < last - first <= (self.max_batch if batch else 1):
            raise ValueError(f"a request holds 1 to {self.max_batch if batch else 1} queries, "
                             f"got {last - first}")

        async def once() -> Answer:
            halves = await self._both(*(self._ask_party(side, window, first, last, batch)
                                        for side in (0, 1)))
            return combine(self.servers, *halves)

        return await self._retrying(once, window)

    async def _retrying(self, call, window: Optional[Window] = None):
        """call() until it returns, retrying mismatches and busy parties for switch_deadline
        seconds from the first; a query request (a window's) goes out within the client's
        congestion window."""
        deadline = None
        pause = FIRST_RETRY_S
        gate = self._congestion() if window is not None else None
        while True:
            try:
                if gate is None:
                    return await call()
                async with gate.slot() as waited:
                    if deadline is not None:  # waiting here is not asking a busy party
                        deadline += waited
                    answer = await call()
                gate.answered()
                return answer
            except EpochMismatch:
                wait = pause
                deadline = deadline or time.monotonic() + self.switch_deadline
                if time.monotonic() + wait > deadline:
                    raise
            except ServerError as exc:
                if exc.status not in RETRIED_STATUSES:
                    raise
                if gate is not None:
                    gate.refused()
                wait = exc.retry_after if exc.retry_after is not None else pause
                deadline = deadline or time.monotonic() + self.switch_deadline
                if time.monotonic() + wait > deadline:
                    raise
            await asyncio.sleep(wait)
            pause = min(2 * pause, MAX_RETRY_S)
            if window is not None:
                await self._check_shape(window)

    def _congestion(self) -> Congestion:
        """The client's congestion window over its query requests, made on the first one and
        again when in_flight changes (set, or chosen from /health by a later fetch)."""
        limit = self.in_flight or DEFAULT_IN_FLIGHT
        if self._gate is None or self._gate.limit != limit:
            self._gate = Congestion(limit)
        return self._gate

    async def _check_shape(self, window: Window) -> None:
        try:
            info = await self.epoch()
        except EpochMismatch:
            return  # still switching: the next try tells
        if info.num_pages != self._shape[0] or info.domain_bits != self._shape[1]:
            raise EpochMismatch(
                f"the servers switched to epoch {info.epoch_id} of {info.num_pages} pages at "
                f"domain_bits {info.domain_bits} during the fetch; its keys were made for "
                f"{self._shape[0]} pages at domain_bits {self._shape[1]}: fetch again"
            )

    # -- fetches ------------------------------------------------------------------------------
    async def iter_answers(self, rows: Iterable[int], batch: bool = True
                           ) -> AsyncIterator[tuple[np.ndarray, list[bytes]]]:
        """(rows, their 256-byte contents) request by request, in the order asked.

        `rows` may be any iterable (a generator of millions): it is read a window (in_flight
        requests) at a time, and each window's keys are made in one vectorised call on a planner
        while earlier requests are answered, so memory holds a few windows of keys and in_flight
        answers, whatever its length."""
        info = await self.settled_epoch()
        self._shape = (info.num_pages, info.domain_bits)
        self.last_key_format = self.key_format_for(info)
        key_format = format_by_name(self.last_key_format)
        step = self.max_batch if batch else 1

        def take(source, count: int) -> np.ndarray:
            taken = np.fromiter(itertools.islice(source, count), dtype=np.int64)
            bad = (taken < 0) | (taken >= info.num_rows)
            if bad.any():
                raise ValueError(f"row {int(taken[np.argmax(bad)])} is outside "
                                 f"[0, {info.num_rows})")
            return taken

        pipeline = self._pipelined(
            rows, take, lambda taken: (plan_window, taken, info.num_pages, info.domain_bits,
                                       key_format),
            lambda window, first, last: self.ask(window, first, last, batch),
            lambda asked, answer: (asked, answer.rows(asked)), step)
        async with contextlib.aclosing(pipeline):  # its requests cancelled as this one ends
            async for found in pipeline:
                yield found

    async def _pipelined(self, source: Iterable, take, plan, ask, found, step: int):
        """found(items, answer) request by request, in the order asked: `source` is read a
        window at a time (take(iterator, in_flight * step), empty at its end), the window's
        keys made by plan(items) -> (function, *arguments) on a planner while earlier requests
        are answered, and items[first:last] asked by ask(window, first, last), `step` items a
        request and in_flight requests at each party at once. Memory holds a few windows of
        keys and in_flight answers, however long `source` is."""
        in_flight = await self.requests_in_flight()
        loop = asyncio.get_running_loop()
        source = iter(source)
        ahead: collections.deque = collections.deque()  # (items, their window being planned)
        pending: collections.deque = collections.deque()  # (items, request in flight), in order
        exhausted = False

        def plan_more() -> None:
            """Read the next windows' items and start planning them, up to the planners' depth."""
            nonlocal exhausted
            while not exhausted and len(ahead) < self._planner_depth() + 1:
                items = take(source, in_flight * step)
                if len(items) == 0:
                    exhausted = True
                    return
                # a fetch of several windows: key-making processes pay for themselves
                planners = self._planner_pool() if ahead or pending else None
                ahead.append((items, loop.run_in_executor(planners, *plan(items))))

        async def take_first():
            items, task = pending[0]
            answer = await task
            pending.popleft()
            return found(items, answer)

        try:
            plan_more()
            while ahead:
                items, planned = ahead[0]
                window = await planned
                ahead.popleft()
                plan_more()  # the next windows' keys are made while this one is answered
                for first in range(0, len(items), step):
                    while len(pending) >= in_flight:
                        yield await take_first()
                    last = min(first + step, len(items))
                    pending.append((items[first:last],
                                    asyncio.ensure_future(ask(window, first, last))))
            while pending:
                yield await take_first()
        finally:
            for _, task in pending:
                task.cancel()
            await asyncio.gather(*(task for _, task in pending),
                                 *(planned for _, planned in ahead), return_exceptions=True)

    def _planner_depth(self) -> int:
        """Key-making processes of a long fetch: windows planned at once beside the one sent."""
        return self.planners if self.planners is not None else auto_planners()

    def _planner_pool(self) -> Optional[Planners]:
        """Processes that make keys beside this one (none: a thread of this process), started
        on the first fetch of several windows and kept until close, or until they have all
        ended: key generation then takes no time from the event loop's own thread, which reads
        the answers."""
        count = self._planner_depth()
        if count == 0:
            return None
        if self._planners_pool is not None and self._planners_pool.broken:
            # its processes ended (killed, out of memory): that fetch failed, this one starts anew
            self._planners_pool.close()
            self._planners_pool = None
        if self._planners_pool is None:
            self._planners_pool = Planners(count)
        return self._planners_pool

    async def iter_rows(self, rows: Iterable[int], batch: bool = True
                        ) -> AsyncIterator[tuple[int, bytes]]:
        """(row, 256 bytes) in the order asked, as the answers come; see iter_answers."""
        async with contextlib.aclosing(self.iter_answers(rows, batch)) as answers:
            async for asked, data in answers:
                for row, content in zip(asked.tolist(), data):
                    yield row, content

    async def fetch_rows(self, rows: Sequence[int], batch: bool = True) -> list[bytes]:
        """The 256-byte rows, in the order asked."""
        out: list[bytes] = []
        async with contextlib.aclosing(self.iter_answers([int(r) for r in rows], batch)) as answers:
            async for _, data in answers:
                out.extend(data)
        return out

    async def fetch_row(self, row: int) -> bytes:
        return (await self.fetch_rows([row], batch=False))[0]

    async def fetch_pages(self, pages: Sequence[int]) -> Answer:
        """One batch of queries for whole pages chosen by the caller (at most max_batch): each
        hidden among two decoys, both parties asked at once, the pages XORed, state checked."""
        info = await self.settled_epoch()
        self._shape = (info.num_pages, info.domain_bits)
        self.last_key_format = self.key_format_for(info)
        pages = np.asarray(pages, dtype=np.int64)
        window = self.plan(info, pages * ROWS_PER_PAGE, pages)
        return await self.ask(window)

    async def aclose(self) -> None:
        if self._planners_pool is not None:
            self._planners_pool.close()
            self._planners_pool = None
        for pool in self._wire:
            if pool is not None:
                pool.close()
        self._wire = [None, None]
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> "AsyncPirClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

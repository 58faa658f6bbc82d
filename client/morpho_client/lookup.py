"""Lookups by key (docs/PROTOCOL.md section 9): one query of the key's three candidate pages.

Every key costs one query whatever the answer: its three candidate pages, computed from the
records table that both parties' /epoch publish, in one batch request to each party. Nothing
that follows depends on whether the key was found, so present and absent keys make the same
requests, of the same sizes. The three pages come back XORed from one state (the client's
usual check), and the key's row is picked among their 48 rows by its full key.
"""
from __future__ import annotations

import contextlib
import itertools
import json
from typing import AsyncIterator, Iterable, Optional, Sequence

import numpy as np

from morpho_pir.dpf import format_by_name
from morpho_pir.http import ANSWER_BYTES, BATCH_PATH, EPOCH_HEADER, OCTET_STREAM, RECORDS_HEADER
from morpho_pir.keygen import gen_key_pairs
from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES, HexError, parse_hex
from morpho_pir.records import Record, RecordsError, RecordsTable

from morpho_client.core import (Answer, EpochInfo, Half, PirError, ServerError, combine,
                                served_state, unhex_page)
from morpho_client.plan import Window, listed_lines

JSON = "application/json"


class NotRecords(PirError):
    """The parties serve pages without a records table: there is nothing to look a key up in."""


def records_table(info: EpochInfo, servers: Sequence[str]) -> RecordsTable:
    """The records table of the epoch both parties serve, from its /epoch `records`."""
    if info.records is None:
        raise NotRecords(f"the servers ({servers[0]}, {servers[1]}) serve epoch {info.epoch_id} "
                         f"without a records table (no `records` in /epoch): look rows up by "
                         f"number instead")
    try:
        table = RecordsTable.from_description(info.records)
    except RecordsError as exc:
        raise ServerError(f"{servers[0]}/epoch: {exc}") from None
    if table.num_pages != info.num_pages:
        raise ServerError(f"{servers[0]}/epoch: a records table of {table.num_pages} pages in an "
                          f"epoch of {info.num_pages} pages")
    return table


def plan_lookups(table: RecordsTable, keys: Sequence[bytes], domain_bits: int,
                 key_format: int) -> Window:
    """One query per key: keys for its three candidate pages, in the table's order."""
    pages = table.candidate_pages_many(keys)
    pairs = gen_key_pairs(pages.reshape(-1), domain_bits, key_format=key_format)
    count = len(keys)
    return Window(rows=np.arange(count, dtype=np.int64), pages=pages,
                  slots=np.zeros(count, dtype=np.int64),
                  keys=(pairs.key_array(0), pairs.key_array(1)), key_format=key_format)


def _binary_pages(url: str, headers, payload: bytes, count: int) -> Half:
    kind = headers.get("Content-Type", "").split(";")[0].strip()
    if kind != OCTET_STREAM:
        raise ServerError(f"{url}: expected {OCTET_STREAM} answers, got {kind}")
    if len(payload) != count * ANSWER_BYTES:
        raise ServerError(f"{url}: expected {count * ANSWER_BYTES} bytes of answers, got "
                          f"{len(payload)}")
    try:
        epoch_id = int(headers.get(EPOCH_HEADER, ""))
    except ValueError:
        raise ServerError(f"{url}: expected the epoch in {EPOCH_HEADER}") from None
    pages = np.frombuffer(payload, dtype=np.uint8).reshape(count, KEYS_PER_QUERY, PAGE_BYTES)
    return Half(epoch_id, served_state(headers), pages)


def _json_pages(url: str, headers, reply, count: int) -> Half:
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or len(results) != count:
        raise ServerError(f"{url}: expected {count} results, got {results!r:.80}")
    pages = np.empty((count, KEYS_PER_QUERY, PAGE_BYTES), dtype=np.uint8)
    for index, result in enumerate(results):
        got = result.get("pages") if isinstance(result, dict) else None
        if not isinstance(got, list) or len(got) != KEYS_PER_QUERY:
            raise ServerError(f"{url}: query {index}: expected {KEYS_PER_QUERY} pages")
        for slot, text in enumerate(got):
            pages[index, slot] = np.frombuffer(unhex_page(text, f"{url}: query {index}"),
                                               np.uint8)
    return Half(reply.get("epoch_id"), served_state(headers), pages)


class Lookups:
    """lookup(), lookup_many(), lookup_records() and iter_lookups() of AsyncPirClient: the
    fetches' pipeline (requests kept in flight on the parties' own connections, keys made
    ahead by the planners), with each query's three pages kept and its key matched in them."""

    async def _ask_lookup_party(self, side: int, window: Window, first: int, last: int,
                                fingerprint: str) -> Half:
        url = self.servers[side] + BATCH_PATH
        encoding = self.encoding_for(side)
        self._used[side] = encoding
        headers = {RECORDS_HEADER: fingerprint}
        try:
            if encoding == "binary":
                answered, payload = await self._post(side, BATCH_PATH,
                                                     window.body(side, first, last),
                                                     OCTET_STREAM, headers)
                return _binary_pages(url, answered, payload, last - first)
            body = {"queries": [{"keys": q} for q in window.hex_queries(side, first, last)]}
            answered, payload = await self._post(side, BATCH_PATH, json.dumps(body).encode(),
                                                 JSON, headers)
            try:
                reply = json.loads(payload)
            except ValueError:
                raise ServerError(f"{url}: the response is not JSON") from None
            return _json_pages(url, answered, reply, last - first)
        except ServerError as exc:
            if exc.status == 409:
                raise PirError(f"{exc}: the party serves another records table than the one the "
                               f"keys were made for (an epoch switch): look the keys up again"
                               ) from None
            raise

    async def _ask_lookups(self, window: Window, first: int, last: int,
                           fingerprint: str) -> Answer:
        async def once() -> Answer:
            halves = await self._both(*(self._ask_lookup_party(side, window, first, last,
                                                               fingerprint) for side in (0, 1)))
            return combine(self.servers, *halves)

        return await self._retrying(once, window)

    async def iter_lookups(self, keys: Iterable[bytes]
                           ) -> AsyncIterator[tuple[list[bytes], list[Optional[Record]]]]:
        """(keys, their Records or None) request by request, in the order asked.

        One query per key (its three candidate pages), max_batch to a request, in_flight
        requests at each party at once; `keys` is read a window (in_flight requests) at a time
        and each window's keys made on a planner while earlier requests are answered, as
        iter_answers does. A key found twice is a RecordsError (a corrupt table)."""
        async with contextlib.aclosing(self._lookups(await self.settled_epoch(), keys)) as found:
            async for each in found:
                yield each

    def _lookups(self, info: EpochInfo, keys: Iterable[bytes]) -> AsyncIterator:
        """The fetches' pipeline (AsyncPirClient._pipelined) over keys: (keys, Records or None)."""
        table = records_table(info, self.servers)
        self._shape = (info.num_pages, info.domain_bits)
        self.last_key_format = self.key_format_for(info)
        key_format = format_by_name(self.last_key_format)
        return self._pipelined(
            keys, lambda source, count: [table.check_key(key)
                                         for key in itertools.islice(source, count)],
            lambda chunk: (plan_lookups, table, chunk, info.domain_bits, key_format),
            lambda window, first, last: self._ask_lookups(window, first, last,
                                                          table.fingerprint_hex),
            lambda asked, answer: (asked, table.find_many(asked, answer.pages)),
            self.max_batch)

    async def lookup_records(self, keys: Sequence[bytes]) -> list[Optional[Record]]:
        """Each key's Record (its value and type), or None where the table does not hold it;
        every key's length is checked before any query is sent (iter_lookups)."""
        info = await self.settled_epoch()
        table = records_table(info, self.servers)
        keys = [table.check_key(key) for key in keys]
        found: list[Optional[Record]] = []
        async with contextlib.aclosing(self._lookups(info, keys)) as lookups:
            async for _, records in lookups:
                found.extend(records)
        return found

    async def lookup_many(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        """Each key's value, or None where the table does not hold it (lookup_records)."""
        return [None if record is None else record.value
                for record in await self.lookup_records(keys)]

    async def lookup(self, key: bytes) -> Optional[bytes]:
        """The key's value, or None: one query of its three candidate pages."""
        return (await self.lookup_many([key]))[0]


def parse_key(text: str) -> bytes:
    """A key as hex digits, 0x optional; ValueError saying what was wrong."""
    try:
        return parse_hex(text.strip())
    except HexError as exc:
        raise ValueError(f"key {text.strip()!r}: {exc}") from None


def read_keys_file(path) -> list[bytes]:
    """Keys as hex, one per line (blank lines and # comments skipped); ValueError names a line."""
    keys = []
    for number, text in listed_lines(path):
        try:
            keys.append(parse_key(text))
        except ValueError as exc:
            raise ValueError(f"{path}, line {number}: {exc}") from None
    if not keys:
        raise ValueError(f"{path}: no keys in it")
    return keys

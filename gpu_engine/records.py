"""Building a records table (cuckoo pages, docs/PROTOCOL.md section 9) and changing it in place.

A page is a bucket of 16 rows and each key has three candidate pages, so the table loads past
0.95 with short eviction walks (three choices of a bucket of 8 or more slots reach 0.999). The
build places most records in vectorised rounds, then each one left over by a breadth-first
eviction walk of bounded length; one that finds no room makes the build start again with a new
seed, then with more pages. Nothing is dropped and there is no stash: every record is in a row
a client reads. Changes after the build (set, delete) use the same walk, deterministically, so
two parties that take the same changes in the same order write the same rows.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from morpho_pir.protocol import KEYS_PER_QUERY, ROW_BYTES, ROWS_PER_PAGE
from morpho_pir.records import (
    MIN_PAGES,
    ROW_HEADER_BYTES,
    RecordsError,
    RecordsTable,
    distinct_pages,
    hash_prefix,
    hash_words,
)

log = logging.getLogger(__name__)

DEFAULT_LOAD = 0.96  # records per row the build aims at; at least 0.95 with room to spare
MAX_WALK_PAGES = 512  # pages an eviction walk may look at before it gives up
SEED_TRIES = 3  # seeds tried at one page count before the build adds pages
GROWTH = 1.01  # the page count's factor at each growth
PARALLEL_FROM = 200_000  # keys from which hashing is spread over processes
HASH_CHUNK = 100_000


class NoRoom(RecordsError):
    """An eviction walk found no free row within MAX_WALK_PAGES pages."""


# -- the hash, over many keys ----------------------------------------------------------------

def _hash_chunk(args) -> np.ndarray:
    seed, raw, key_bytes = args
    keys = [raw[i:i + key_bytes] for i in range(0, len(raw), key_bytes)]
    words = np.empty((len(keys), KEYS_PER_QUERY), dtype=np.uint64)
    for index in range(KEYS_PER_QUERY):
        words[:, index] = hash_words(hash_prefix(seed, index), keys)
    return words


def hash_all(seed: int, keys: np.ndarray, workers: Optional[int] = None) -> np.ndarray:
    """(n, 3) u64 hash words of the (n, key_bytes) u8 keys; over processes for many keys."""
    n, key_bytes = keys.shape
    raw = keys.tobytes()
    step = HASH_CHUNK * key_bytes
    chunks = [(seed, raw[i:i + step], key_bytes) for i in range(0, len(raw), step)]
    workers = workers or os.cpu_count() or 1
    if n < PARALLEL_FROM or workers < 2 or len(chunks) < 2:
        parts = [_hash_chunk(chunk) for chunk in chunks]
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(chunks))) as pool:
            parts = list(pool.map(_hash_chunk, chunks))
    return np.concatenate(parts) if parts else np.empty((0, KEYS_PER_QUERY), dtype=np.uint64)


# -- the eviction walk, shared by the build and by changes ------------------------------------

Move = Tuple[int, int, int]  # (page, slot, to_page): the record in page's slot moves to to_page


def eviction_walk(starts: Sequence[int], has_room: Callable[[int], bool],
                  occupants: Callable[[int], Sequence[Sequence[int]]],
                  max_pages: int = MAX_WALK_PAGES) -> Optional[Tuple[int, List[Move]]]:
    """The shortest walk that frees a row in one of `starts` (all full), breadth first.

    occupants(page) gives, slot by slot, the other candidate pages of the record in that slot.
    Returns (the start page freed, the moves to make in order) or None past max_pages pages.
    Deterministic: pages and slots are taken in order, so the same table gives the same walk.
    """
    parent: Dict[int, Optional[Tuple[int, int]]] = {page: None for page in starts}
    queue = deque(starts)
    while queue:
        page = queue.popleft()
        for slot, others in enumerate(occupants(page)):
            for other in others:
                if other in parent:
                    continue
                parent[other] = (page, slot)
                if has_room(other):
                    moves: List[Move] = []
                    target = other
                    while parent[target] is not None:
                        source, source_slot = parent[target]
                        moves.append((source, source_slot, target))
                        target = source
                    return target, moves  # moves in order: the one into the free row first
                if len(parent) >= max_pages:
                    return None
                queue.append(other)
    return None


# -- building ---------------------------------------------------------------------------------

def _place(pages: np.ndarray, num_pages: int) -> np.ndarray:
    """(num_pages, 16) record indices (-1: empty) holding every record, or NoRoom."""
    occupied = np.full((num_pages, ROWS_PER_PAGE), -1, dtype=np.int64)
    fill = np.zeros(num_pages, dtype=np.int64)
    waiting = np.arange(pages.shape[0], dtype=np.int64)
    # Vectorised first-fit rounds: each waiting record asks its candidate r; a page takes them in
    # record order while it has rows.
    for choice in range(KEYS_PER_QUERY):
        if not waiting.size:
            break
        asked = pages[waiting, choice]
        order = np.argsort(asked, kind="stable")
        asked, records = asked[order], waiting[order]
        starts = np.flatnonzero(np.r_[True, asked[1:] != asked[:-1]])
        rank = np.arange(asked.size) - np.repeat(starts, np.diff(np.r_[starts, asked.size]))
        slot = fill[asked] + rank
        taken = slot < ROWS_PER_PAGE
        occupied[asked[taken], slot[taken]] = records[taken]
        np.add.at(fill, asked[taken], 1)
        waiting = np.sort(records[~taken])
    # The rest by eviction walks, in record order.
    occupants_of = _array_occupants(occupied, pages)
    for record in waiting.tolist():
        _insert_walk(occupied, fill, pages, record, occupants_of)
    return occupied


def _array_occupants(occupied: np.ndarray, pages: np.ndarray):
    def occupants(page: int) -> List[List[int]]:
        result = []
        for record in occupied[page].tolist():
            result.append([p for p in pages[record].tolist() if p != page])
        return result
    return occupants


def _insert_walk(occupied, fill, pages, record: int, occupants) -> None:
    starts = pages[record].tolist()
    walk = eviction_walk(starts, lambda page: bool(fill[page] < ROWS_PER_PAGE), occupants)
    if walk is None:
        raise NoRoom(f"record {record} found no free row within {MAX_WALK_PAGES} pages")
    freed, moves = walk
    for page, slot, target in moves:
        occupied[target, fill[target]] = occupied[page, slot]
        fill[target] += 1
        occupied[page, slot] = occupied[page, fill[page] - 1]  # keep each page's rows packed
        occupied[page, fill[page] - 1] = -1
        fill[page] -= 1
    occupied[freed, fill[freed]] = record
    fill[freed] += 1


@dataclass
class Built:
    table: RecordsTable
    rows: np.ndarray  # (num_pages * 16, 256) u8: the matrix, row by row
    seeds_tried: int

    @property
    def load(self) -> float:
        return float(np.count_nonzero(self.rows[:, 0])) / self.rows.shape[0]


def pages_for(count: int, load: float = DEFAULT_LOAD) -> int:
    """The pages that hold `count` records at `load` records per row (at least three)."""
    return max(MIN_PAGES, int(np.ceil(count / (ROWS_PER_PAGE * load))))


def build(keys: np.ndarray, values: np.ndarray, types: np.ndarray, seed: int,
          load: float = DEFAULT_LOAD, num_pages: Optional[int] = None,
          workers: Optional[int] = None) -> Built:
    """A records table of every (key, value, type): (n, K), (n, V) and (n,) u8 arrays.

    Keys must be distinct (RecordsError names the first repeated one) and types 1..255. The
    seed is used first; a placement that fails tries seed + 1, ... (SEED_TRIES of them), then
    GROWTH times more pages, until every record has a row."""
    n, key_bytes = keys.shape
    value_bytes = values.shape[1]
    if n and (types.min() < 1):
        raise RecordsError("type: expected 1..255 for every record (0 marks an empty row)")
    _check_distinct(keys)
    num_pages = num_pages or pages_for(n, load)
    tried = 0
    while True:
        for attempt in range(SEED_TRIES):
            table = RecordsTable(seed=(seed + tried) & ((1 << 64) - 1), num_pages=num_pages,
                                 key_bytes=key_bytes, value_bytes=value_bytes)
            tried += 1
            pages = distinct_pages(hash_all(table.seed, keys, workers), num_pages)
            try:
                occupied = _place(pages, num_pages)
            except NoRoom as exc:
                log.info("seed %d, %d pages: %s; trying again", table.seed, num_pages, exc)
                continue
            return Built(table, _rows(occupied, keys, values, types), tried)
        num_pages = int(np.ceil(num_pages * GROWTH))


def _check_distinct(keys: np.ndarray) -> None:
    if keys.shape[0] < 2:
        return
    view = np.ascontiguousarray(keys).view(np.dtype((np.void, keys.shape[1]))).ravel()
    order = np.argsort(view, kind="stable")
    same = np.flatnonzero(view[order][1:] == view[order][:-1])
    if same.size:
        first, second = sorted(order[same[0]:same[0] + 2].tolist())
        raise RecordsError(f"key 0x{keys[first].tobytes().hex()} is given twice (records "
                           f"{first} and {second}): keys must be distinct")


def _rows(occupied: np.ndarray, keys, values, types) -> np.ndarray:
    num_pages = occupied.shape[0]
    rows = np.zeros((num_pages * ROWS_PER_PAGE, ROW_BYTES), dtype=np.uint8)
    flat = occupied.ravel()
    where = np.flatnonzero(flat >= 0)
    records = flat[where]
    key_end = ROW_HEADER_BYTES + keys.shape[1]
    rows[where, 0] = types[records]
    rows[where, ROW_HEADER_BYTES:key_end] = keys[records]
    rows[where, key_end:key_end + values.shape[1]] = values[records]
    return rows


# -- changes after the build ------------------------------------------------------------------

ReadPage = Callable[[int], Sequence[bytes]]  # page -> its 16 rows of 256 bytes, as served now


class TableView:
    """The rows of a served table as a change sees them: read page by page, written in memory."""

    def __init__(self, table: RecordsTable, read_page: ReadPage) -> None:
        self.table = table
        self._read = read_page
        self._pages: Dict[int, List[bytes]] = {}
        self.written: Dict[int, bytes] = {}  # row index -> its new 256 bytes

    def rows(self, page: int) -> List[bytes]:
        if page not in self._pages:
            self._pages[page] = list(self._read(page))
        return self._pages[page]

    def write(self, page: int, slot: int, row: bytes) -> None:
        self.rows(page)[slot] = row
        self.written[page * ROWS_PER_PAGE + slot] = row

    def free_slot(self, page: int) -> Optional[int]:
        for slot, row in enumerate(self.rows(page)):
            if row[0] == 0:
                return slot
        return None

    def locate(self, key: bytes) -> Optional[Tuple[int, int]]:
        """(page, slot) of key's row, or None; RecordsError if it is in more than one."""
        hits = []
        for page in self.table.candidate_pages(key):
            for slot, row in enumerate(self.rows(page)):
                record = self.table.decode_row(row)
                if record is not None and record.key == key:
                    hits.append((page, slot))
        if len(hits) > 1:
            raise RecordsError(f"key 0x{key.hex()} is in {len(hits)} rows: the table is corrupt")
        return hits[0] if hits else None

    def _occupants(self, page: int) -> List[List[int]]:
        result = []
        for row in self.rows(page):
            record = self.table.decode_row(row)
            result.append([] if record is None else
                          [p for p in self.table.candidate_pages(record.key) if p != page])
        return result

    def set(self, key: bytes, value: bytes, record_type: int = 1) -> Dict[int, bytes]:
        """Write key's record: over its row if it has one, else into a free row of a candidate
        page, else by an eviction walk (NoRoom past MAX_WALK_PAGES). Returns the rows written."""
        row = self.table.encode_row(key, value, record_type)
        where = self.locate(key)
        if where is None:
            for page in self.table.candidate_pages(key):
                slot = self.free_slot(page)
                if slot is not None:
                    where = (page, slot)
                    break
        if where is None:
            walk = eviction_walk(self.table.candidate_pages(key),
                                 lambda page: self.free_slot(page) is not None, self._occupants)
            if walk is None:
                raise NoRoom(
                    f"no room for key 0x{key.hex()}: its candidate pages are full and an eviction "
                    f"walk of {MAX_WALK_PAGES} pages found no free row; rebuild the records epoch "
                    f"with more pages (manage.py build_records --load lower)")
            freed, moves = walk
            for page, slot, target in moves:
                self.write(target, self.free_slot(target), self.rows(page)[slot])
                self.write(page, slot, bytes(ROW_BYTES))
            where = (freed, self.free_slot(freed))
        self.write(*where, row)
        return dict(self.written)

    def delete(self, key: bytes) -> Dict[int, bytes]:
        """Clear key's row (zeros); nothing is written when the key is absent."""
        where = self.locate(self.table.check_key(key))
        if where is not None:
            self.write(*where, bytes(ROW_BYTES))
        return dict(self.written)

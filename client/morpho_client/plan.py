"""The client's query plans: decoy pages, keys made a window at a time, the bulk fetch's state file."""
from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from morpho_pir.dpf import KEY_FORMAT_V1, key_length
from morpho_pir.keygen import KeyPairs, gen_key_pairs, random_root_seeds
from morpho_pir.protocol import KEYS_PER_QUERY, ROWS_PER_PAGE

STATE_FORMAT = 1


class StateError(ValueError):
    """The state file cannot be used for this fetch; the message says why and what to do."""


def choose_pages(page: int, num_pages: int, rand: secrets.SystemRandom) -> tuple[list[int], int]:
    """`page` and two other pages drawn at random, in random order, and the slot of `page`."""
    if not 0 <= page < num_pages:
        raise ValueError(f"page {page} is outside [0, {num_pages})")
    if num_pages >= KEYS_PER_QUERY:
        decoys: list[int] = []
        while len(decoys) < KEYS_PER_QUERY - 1:
            candidate = rand.randrange(num_pages)
            if candidate != page and candidate not in decoys:
                decoys.append(candidate)
    else:
        # Fewer than three pages exist: repeat the other page so a query still has three keys.
        others = [p for p in range(num_pages) if p != page] or [page]
        decoys = [rand.choice(others) for _ in range(KEYS_PER_QUERY - 1)]
    pages = [page] + decoys
    rand.shuffle(pages)
    return pages, pages.index(page)


def _uniform(count: int, bound: int) -> np.ndarray:
    """`count` integers uniform in [0, bound) from the OS's CSPRNG (a 64-bit draw reduced modulo
    `bound`: a bias below 2**-38 for any page count the protocol allows)."""
    raw = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    return (raw % np.uint64(bound)).astype(np.int64)


def choose_pages_many(pages: np.ndarray, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """choose_pages for every page at once: ((K, 3) pages, (K,) slots), decoys distinct from
    their page and from each other, the wanted page at a uniform slot."""
    pages = np.asarray(pages, dtype=np.int64).reshape(-1)
    bad = (pages < 0) | (pages >= num_pages)
    if bad.any():
        raise ValueError(f"page {int(pages[np.argmax(bad)])} is outside [0, {num_pages})")
    k = pages.shape[0]
    if num_pages < KEYS_PER_QUERY:  # too few pages for distinct decoys: the scalar rule
        rand = secrets.SystemRandom()
        chosen = [choose_pages(int(page), num_pages, rand) for page in pages]
        return (np.array([c for c, _ in chosen], dtype=np.int64).reshape(k, KEYS_PER_QUERY),
                np.array([s for _, s in chosen], dtype=np.int64))
    decoys = np.empty((k, KEYS_PER_QUERY - 1), dtype=np.int64)
    for column in range(KEYS_PER_QUERY - 1):
        draw = _uniform(k, num_pages)
        while True:  # redraw the decoys that hit their page or an earlier decoy
            clash = draw == pages
            for earlier in range(column):
                clash |= draw == decoys[:, earlier]
            if not clash.any():
                break
            draw[clash] = _uniform(int(clash.sum()), num_pages)
        decoys[:, column] = draw
    slots = _uniform(k, KEYS_PER_QUERY)
    out = np.empty((k, KEYS_PER_QUERY), dtype=np.int64)
    # The decoys fill the other slots in the order drawn (itself uniform).
    others = np.argsort(np.arange(KEYS_PER_QUERY)[None, :] == slots[:, None], axis=1,
                        kind="stable")[:, :KEYS_PER_QUERY - 1]
    np.put_along_axis(out, others, decoys, axis=1)
    out[np.arange(k), slots] = pages
    return out, slots


@dataclass(frozen=True)
class Window:
    """The queries of one or more requests, planned together: rows, their pages' three
    candidates, the wanted slot and both parties' serialized keys (three per query)."""

    rows: np.ndarray  # (Q,) int64
    pages: np.ndarray  # (Q, 3) int64
    slots: np.ndarray  # (Q,) int64
    keys: tuple  # (party 0's, party 1's) (3Q, key_size) u8 arrays
    key_format: int

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def body(self, party: int, first: int, last: int) -> bytes:
        """Party `party`'s keys of queries [first, last), concatenated (the binary body)."""
        return self.keys[party][KEYS_PER_QUERY * first:KEYS_PER_QUERY * last].tobytes()

    def hex_queries(self, party: int, first: int, last: int) -> list[list[str]]:
        """The same keys as the JSON body's `[[k0, k1, k2], ...]` of hex strings."""
        size = self.keys[party].shape[1]
        text = self.body(party, first, last).hex()
        keys = [text[i:i + 2 * size] for i in range(0, len(text), 2 * size)]
        return [keys[i:i + KEYS_PER_QUERY] for i in range(0, len(keys), KEYS_PER_QUERY)]


def plan_window(rows, num_pages: int, domain_bits: int, key_format: int = KEY_FORMAT_V1,
                pages=None) -> Window:
    """Plan every row's query at once: decoys, then all 3Q key pairs in one vectorised call.

    `pages` (one per row) overrides the row's own page (row // 16): a caller that picks pages
    itself (a lookup by key) passes them, with any row numbers it likes to tell them apart."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    targets = rows // ROWS_PER_PAGE if pages is None else np.asarray(pages, dtype=np.int64)
    candidates, slots = choose_pages_many(targets, num_pages)
    pairs = gen_key_pairs(candidates.reshape(-1), domain_bits, key_format=key_format)
    return Window(rows=rows, pages=candidates, slots=slots,
                  keys=(pairs.key_array(0), pairs.key_array(1)), key_format=key_format)


@dataclass(frozen=True)
class PlannedQuery:
    """One query: three candidate pages (the wanted one hidden among them) and both key sets."""

    pages: tuple[int, int, int]
    target_slot: int  # which of the three answers holds the wanted page
    keys_a: tuple[str, str, str]  # hex keys of party 0, for server A
    keys_b: tuple[str, str, str]  # hex keys of party 1, for server B


def plan_queries(pages: Sequence[int], num_pages: int, domain_bits: int,
                 key_format: int = KEY_FORMAT_V1) -> list[PlannedQuery]:
    """plan_window for whole pages, one PlannedQuery (hex keys) per page."""
    window = plan_window(np.asarray(pages, dtype=np.int64) * ROWS_PER_PAGE, num_pages,
                         domain_bits, key_format, pages)
    hex_a, hex_b = (window.hex_queries(party, 0, len(window)) for party in (0, 1))
    return [PlannedQuery(pages=tuple(candidates), target_slot=slot, keys_a=tuple(a),
                         keys_b=tuple(b))
            for candidates, slot, a, b in zip(window.pages.tolist(), window.slots.tolist(),
                                              hex_a, hex_b)]


def plan_query(page: int, num_pages: int, domain_bits: int,
               key_format: int = KEY_FORMAT_V1) -> PlannedQuery:
    """Key pairs for `page` and two other pages drawn at random, in random order."""
    return plan_queries([page], num_pages, domain_bits, key_format)[0]


@dataclass
class BulkState:
    """Everything a rerun needs to resume the same jobs and combine their answers.

    The keys are not stored: their root seeds are (32 bytes a key pair), and the keys are made
    again from them, byte for byte, when a party's job still has to be submitted. Bulk jobs take
    v1 keys only (docs/PROTOCOL.md section 5.5), so these are v1 keys whatever the parties offer.
    """

    servers: tuple[str, str]
    epoch_id: int
    num_pages: int
    domain_bits: int
    rows: list[int]
    pages: np.ndarray  # (Q, 3) int64: the three pages of each query
    slots: np.ndarray  # (Q,) int64: which of the three is the row's page
    seeds: np.ndarray  # (Q, 3, 2, 16) u8: root seeds of party 0 and party 1 for each key
    jobs: list = field(default_factory=lambda: [None, None])  # job id at A, at B

    @classmethod
    def plan(cls, servers: Sequence[str], epoch_id: int, num_pages: int, domain_bits: int,
             rows: Sequence[int], pages: Sequence[int],
             rand: Optional[secrets.SystemRandom] = None) -> "BulkState":
        """A fresh plan: for each row (on page `pages[i]`), three pages and fresh root seeds."""
        rand = rand or secrets.SystemRandom()
        chosen = [choose_pages(page, num_pages, rand) for page in pages]
        q = len(chosen)
        return cls(
            servers=(servers[0], servers[1]), epoch_id=epoch_id, num_pages=num_pages,
            domain_bits=domain_bits, rows=list(rows),
            pages=np.array([pages for pages, _ in chosen], dtype=np.int64).reshape(q, 3),
            slots=np.array([slot for _, slot in chosen], dtype=np.int64),
            seeds=random_root_seeds(q * KEYS_PER_QUERY).reshape(q, KEYS_PER_QUERY, 2, 16),
        )

    def key_pairs(self, first: int, last: int) -> KeyPairs:
        """The key pairs of queries [first, last), three per query in slot order."""
        return gen_key_pairs(self.pages[first:last].reshape(-1), self.domain_bits,
                             root_seeds=self.seeds[first:last].reshape(-1, 2, 16),
                             key_format=KEY_FORMAT_V1)

    def ndjson_lines(self, party: int, step: int = 1024) -> Iterator[bytes]:
        """Party `party`'s job body, `{"keys": [k0, k1, k2]}` a line, `step` queries at a time."""
        for first in range(0, len(self.rows), step):
            keys = self.key_pairs(first, min(first + step, len(self.rows))).key_hex(party)
            yield "".join(f'{{"keys": ["{keys[i]}", "{keys[i + 1]}", "{keys[i + 2]}"]}}\n'
                          for i in range(0, len(keys), KEYS_PER_QUERY)).encode()

    def ndjson_length(self) -> int:
        """Bytes of either party's body: every line has the same length at one domain_bits."""
        key = "0" * 2 * key_length(self.domain_bits, KEY_FORMAT_V1)
        return len(self.rows) * len(f'{{"keys": ["{key}", "{key}", "{key}"]}}\n')

    def check_resumes(self, servers: Sequence[str], rows: Sequence[int], path: Path) -> None:
        """Refuse a state file written for other parties or other rows."""
        if tuple(servers) != self.servers:
            raise StateError(
                f"{path} is the state of a fetch from {self.servers[0]} and {self.servers[1]}, "
                f"not {servers[0]} and {servers[1]}; remove it or give another --state"
            )
        if list(rows) != self.rows:
            raise StateError(
                f"{path} is the state of a fetch of other rows ({len(self.rows)} rows, this one "
                f"asks {len(rows)}); remove it or give another --state"
            )

    # -- file ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "servers": list(self.servers),
            "epoch_id": self.epoch_id,
            "num_pages": self.num_pages,
            "domain_bits": self.domain_bits,
            "jobs": list(self.jobs),
            "rows": self.rows,
            "pages": self.pages.tolist(),
            "slots": self.slots.tolist(),
            "seeds": self.seeds.tobytes().hex(),
        }

    @classmethod
    def from_json(cls, body: dict, path: Path) -> "BulkState":
        try:
            if body["format"] != STATE_FORMAT:
                raise StateError(f"{path}: state format {body['format']}, expected {STATE_FORMAT}")
            q = len(body["rows"])
            state = cls(
                servers=tuple(body["servers"]), epoch_id=int(body["epoch_id"]),
                num_pages=int(body["num_pages"]), domain_bits=int(body["domain_bits"]),
                rows=[int(r) for r in body["rows"]],
                pages=np.array(body["pages"], dtype=np.int64).reshape(q, 3),
                slots=np.array(body["slots"], dtype=np.int64).reshape(q),
                seeds=np.frombuffer(bytes.fromhex(body["seeds"]), dtype=np.uint8)
                .reshape(q, KEYS_PER_QUERY, 2, 16).copy(),
                jobs=list(body["jobs"]),
            )
        except StateError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(
                f"{path} is not a bulk fetch state file ({exc!r}); remove it"
            ) from None
        if len(state.servers) != 2 or len(state.jobs) != 2:
            raise StateError(f"{path} is not a bulk fetch state file; remove it")
        return state

    @classmethod
    def load(cls, path: Path) -> "BulkState":
        try:
            body = json.loads(Path(path).read_text())
        except ValueError:
            raise StateError(f"{path} is not JSON: not a bulk fetch state; remove it") from None
        return cls.from_json(body, Path(path))

    def save(self, path: Path) -> None:
        """Write atomically, readable by its owner only: the seeds say which rows were fetched."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "w") as fh:  # mkstemp's file is mode 0600
                json.dump(self.to_json(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def listed_lines(path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a list file's entries: blank lines and # comments skipped."""
    with open(path) as fh:
        for number, text in enumerate(fh, start=1):
            text = text.split("#", 1)[0].strip()
            if text:
                yield number, text


def read_rows_file(path) -> list[int]:
    """Rows one per line (blank lines and # comments skipped); ValueError names a bad line."""
    rows = []
    for number, text in listed_lines(path):
        try:
            rows.append(int(text))
        except ValueError:
            raise ValueError(f"{path}, line {number}: expected a row number, got {text!r}") from None
    if not rows:
        raise ValueError(f"{path}: no rows in it")
    return rows


def parse_result_line(raw: bytes, index: int, page_bytes: int) -> dict:
    """Line `index` of a job's results, checked: that index, an epoch_id, three pages in hex."""
    try:
        line = json.loads(raw)
        pages = line["pages"]
        ok = (line["index"] == index and isinstance(line["epoch_id"], int)
              and isinstance(pages, list) and len(pages) == KEYS_PER_QUERY
              and all(isinstance(p, str) and len(p) == 2 + 2 * page_bytes for p in pages))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"results line {index + 1}: expected "
                         f'{{"index": {index}, "epoch_id", "pages": [3 pages of {page_bytes} '
                         f"bytes in hex]}}, got {bytes(raw[:80])!r}")
    return line

"""The two-server PIR client: fetch rows privately from parties A and B (no Django needed)."""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from morpho_pir.dpf import KEY_FORMAT_V1, format_by_name
from morpho_pir.keygen import gen_key_pairs
from morpho_pir.protocol import (KEY_FORMAT_NAMES, KEYS_PER_QUERY, MAX_BATCH_QUERIES, PAGE_BYTES,
                                 ROW_BYTES, ROWS_PER_PAGE, HexError, parse_hex)
from queries.client_plan import (BulkState, StateError, choose_pages, parse_result_line,
                                 read_rows_file)

NDJSON = "application/x-ndjson"
TOKEN_ENV = ("MORPHO_TOKEN_A", "MORPHO_TOKEN_B")  # bulk job tokens when none is passed
OCTET_STREAM = "application/octet-stream"  # the binary encoding (docs/PROTOCOL.md section 5.3)
EPOCH_HEADER = "X-Morpho-Epoch-Id"
# the served state of every answer (docs/PROTOCOL.md section 6): two parties' answers are XORed
# only when they agree
UPDATES_HEADER = "X-Morpho-State-Updates"
DIGEST_HEADER = "X-Morpho-State-Digest"
MISMATCH_ATTEMPTS = 3  # tries of a fetch whose parties answered from different epochs or states
MISMATCH_RETRY_S = 0.5  # pause before the next try: parties follow a change within a second
ENCODINGS = ("auto", "json", "binary")  # auto: binary where /epoch advertises it, else JSON
# DPF key formats (docs/PROTOCOL.md section 3): auto is v2 (section 3.1, a tree 7 levels
# shallower) where both parties' /epoch list it, else v1
KEY_FORMATS = ("auto",) + KEY_FORMAT_NAMES


class PirError(Exception):
    """The client could not fetch what was asked; the message says why."""


class EpochMismatch(PirError):
    """The two parties serve different epochs or shapes; their answers cannot be combined."""


class StateMismatch(EpochMismatch):
    """The parties answered from one epoch but different row updates (docs/PROTOCOL.md section
    6): XORing would give a wrong row, so the client retries, then raises this."""


class ServerError(PirError):
    """A party answered with an error status or a body the protocol does not allow."""

    def __init__(self, message: str, status: Optional[int] = None, body=None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass(frozen=True)
class EpochInfo:
    """What `GET /epoch` says, reduced to what must match across the two parties."""

    epoch_id: int
    num_pages: int
    num_rows: int
    domain_bits: int
    block_number: int
    state_root: str
    encodings: tuple[str, ...] = ("json",)  # what the party's query endpoints speak
    key_formats: tuple[str, ...] = ("v1",)  # the key formats they take

    @classmethod
    def from_json(cls, body: dict, url: str) -> "EpochInfo":
        try:
            pir = body["page_pir"]
            info = cls(
                epoch_id=int(body["epoch_id"]),
                num_pages=int(pir["num_pages"]),
                num_rows=int(body["num_rows"]),
                domain_bits=int(pir["domain_bits"]),
                block_number=int(body["block_number"]),
                state_root=str(body["state_root"]),
            )
            page_size, rows_per_page = int(pir["page_size_bytes"]), int(pir["rows_per_page"])
            info = _with_encodings(info, body.get("encodings", ["json"]),
                                   body.get("key_formats", ["v1"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"{url}/epoch: not a protocol /epoch body ({exc!r})") from None
        if (page_size, rows_per_page) != (PAGE_BYTES, ROWS_PER_PAGE):
            raise ServerError(
                f"{url}/epoch: expected pages of {PAGE_BYTES} bytes and {ROWS_PER_PAGE} rows, "
                f"got {page_size} bytes and {rows_per_page} rows"
            )
        return info


@dataclass(frozen=True)
class PlannedQuery:
    """One query: three candidate pages (the wanted one hidden among them) and both key sets."""

    pages: tuple[int, int, int]
    target_slot: int  # which of the three answers holds the wanted page
    keys_a: tuple[str, str, str]  # hex keys of party 0, for server A
    keys_b: tuple[str, str, str]  # hex keys of party 1, for server B


def plan_queries(pages: Sequence[int], num_pages: int, domain_bits: int,
                 rand: Optional[secrets.SystemRandom] = None,
                 key_format: int = KEY_FORMAT_V1) -> list[PlannedQuery]:
    """For each page, key pairs for it and two other pages drawn at random, in random order.

    The keys of all the queries are made in one vectorised batch (morpho_pir.keygen), in
    `key_format` (KEY_FORMAT_V1, or KEY_FORMAT_V2 of docs/PROTOCOL.md section 3.1)."""
    rand = rand or secrets.SystemRandom()
    chosen = [choose_pages(page, num_pages, rand) for page in pages]
    pairs = gen_key_pairs([p for candidates, _ in chosen for p in candidates], domain_bits,
                          key_format=key_format)
    keys_a, keys_b = pairs.key_hex(0), pairs.key_hex(1)
    plans = []
    for index, (candidates, slot) in enumerate(chosen):
        at = slice(KEYS_PER_QUERY * index, KEYS_PER_QUERY * (index + 1))
        plans.append(PlannedQuery(pages=tuple(candidates), target_slot=slot,
                                  keys_a=tuple(keys_a[at]), keys_b=tuple(keys_b[at])))
    return plans


def plan_query(page: int, num_pages: int, domain_bits: int,
               rand: Optional[secrets.SystemRandom] = None,
               key_format: int = KEY_FORMAT_V1) -> PlannedQuery:
    """Key pairs for `page` and two other pages drawn at random, in random order."""
    return plan_queries([page], num_pages, domain_bits, rand, key_format)[0]


def _unhex(text, what: str) -> bytes:
    if not isinstance(text, str):
        raise ServerError(f"{what}: expected a hex string, got {type(text).__name__}")
    try:
        raw = parse_hex(text)
    except HexError:
        raise ServerError(f"{what}: not hex") from None
    if len(raw) != PAGE_BYTES:
        raise ServerError(f"{what}: expected {PAGE_BYTES} bytes, got {len(raw)}")
    return raw


def _with_encodings(info: EpochInfo, encodings, key_formats) -> EpochInfo:
    # A server older than the binary encoding does not list its encodings: it speaks JSON; one
    # older than v2 keys does not list its key formats: it takes v1.
    for name, value in (("encodings", encodings), ("key_formats", key_formats)):
        if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
            raise TypeError(f"{name}: expected an array of strings, got {value!r:.60}")
    return dataclasses.replace(info, encodings=tuple(encodings), key_formats=tuple(key_formats))


def _key_bytes(key) -> bytes:
    return bytes(key) if isinstance(key, (bytes, bytearray)) else bytes.fromhex(key)


def _http_error(url: str, exc: urllib.error.HTTPError) -> ServerError:
    """A party's error status as a ServerError quoting its JSON `detail` and Retry-After."""
    text = exc.read().decode("utf-8", "replace")
    try:
        detail = json.loads(text).get("detail", text)
    except (ValueError, AttributeError):
        detail = text
    retry = exc.headers.get("Retry-After")
    hint = f" (retry after {retry} s)" if retry else ""
    return ServerError(f"{url}: HTTP {exc.code}: {detail}{hint}", exc.code, text)


def _served_state(headers) -> Optional[tuple[int, str]]:
    """(rows written, digest) of an answer's state headers; None where the server sends none."""
    updates, digest = headers.get(UPDATES_HEADER), headers.get(DIGEST_HEADER)
    if updates is None or digest is None:
        return None
    return int(updates), digest.lower()


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


class SameServer(PirError, ValueError):
    """Both party URLs name one server: it would see both keys of every pair."""


def server_address(url: str) -> tuple[str, int]:
    """(host, port) a party URL reaches: scheme's default port, case, loopback names folded."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: expected an http:// or https:// URL with a host")
    host = parts.hostname.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
        host = "localhost" if address.is_loopback else address.compressed
    except ValueError:
        if host == "localhost" or host.endswith(".localhost"):
            host = "localhost"
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise ValueError(f"{url!r}: the port is not a number in 0..65535") from None
    return host, port


def check_distinct_servers(server_a: str, server_b: str) -> None:
    """Refuse one server named twice: the privacy of a fetch rests on two servers."""
    host_a, port_a = server_address(server_a)
    if (host_a, port_a) == server_address(server_b):
        raise SameServer(
            f"party A ({server_a}) and party B ({server_b}) are the same server "
            f"({host_a}:{port_a}): it would see both keys of every pair and learn which rows "
            "are read; give the URLs of two parties run by different operators"
        )


class PirClient:
    """Fetches rows from two non-colluding parties; each sees only pseudorandom keys."""

    def __init__(self, server_a: str, server_b: str, timeout: float = 120.0,
                 max_batch: int = MAX_BATCH_QUERIES, encoding: str = "auto",
                 key_format: str = "auto") -> None:
        if not 1 <= max_batch <= MAX_BATCH_QUERIES:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH_QUERIES}, got {max_batch}")
        check_distinct_servers(server_a, server_b)
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        if key_format not in KEY_FORMATS:
            raise ValueError(f"key_format must be one of {', '.join(KEY_FORMATS)}, got {key_format!r}")
        self.encoding = encoding
        self.key_format = key_format
        self.last_key_format: Optional[str] = None  # the format of the last fetch's keys
        self._advertised: tuple = (("json",), ("json",))  # per party, from its /epoch
        self._key_formats: tuple = (("v1",), ("v1",))  # per party, from its /epoch
        self._used: list = [None, None]  # per party, the encoding of its last query request
        self.servers = (server_a.rstrip("/"), server_b.rstrip("/"))
        self.timeout = timeout
        self.max_batch = max_batch
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pir-client")

    # -- transport ----------------------------------------------------------------------------
    def _call(self, base: str, path: str, body: Optional[dict] = None) -> dict:
        return self._request(base, path, body)[0]

    def _open(self, request: urllib.request.Request, url: str):
        """(body, headers) of one request; a party's error status or silence is a ServerError."""
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read(), response.headers
        except urllib.error.HTTPError as exc:
            raise _http_error(url, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"{url}: cannot reach the server ({exc})") from None

    def _request(self, base: str, path: str, body: Optional[dict] = None):
        """(parsed JSON, response headers) of one JSON request; ServerError on any failure."""
        url = base + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            url, data=data, method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        payload, headers = self._open(request, url)
        try:
            return json.loads(payload), headers
        except ValueError:
            raise ServerError(f"{url}: the response is not JSON") from None

    def _both(self, path: str, bodies: Sequence[Optional[dict]] = (None, None)) -> list[dict]:
        # Both parties work at the same time: the latency is the slower one, not the sum.
        futures = [self._pool.submit(self._call, base, path, body)
                   for base, body in zip(self.servers, bodies)]
        return [future.result() for future in futures]

    # -- protocol -----------------------------------------------------------------------------
    def epoch(self) -> EpochInfo:
        """The epoch both parties serve; EpochMismatch if they differ in id or shape."""
        infos = [EpochInfo.from_json(body, base)
                 for body, base in zip(self._both("/epoch"), self.servers)]
        a, b = infos
        self._advertised = (a.encodings, b.encodings)
        self._key_formats = (a.key_formats, b.key_formats)
        if a.epoch_id != b.epoch_id:
            raise EpochMismatch(
                f"the servers serve different epochs: A ({self.servers[0]}) epoch {a.epoch_id}, "
                f"B ({self.servers[1]}) epoch {b.epoch_id}; their answers cannot be combined"
            )
        if (a.num_pages, a.domain_bits, a.num_rows) != (b.num_pages, b.domain_bits, b.num_rows):
            raise EpochMismatch(
                f"the servers serve different shapes in epoch {a.epoch_id}: A has {a.num_pages} "
                f"pages at domain_bits {a.domain_bits}, B has {b.num_pages} pages at domain_bits "
                f"{b.domain_bits}"
            )
        return a

    def fetch_rows(self, rows: Sequence[int], batch: bool = True) -> list[bytes]:
        """The 256-byte rows, in the order asked; one batch request per max_batch rows."""
        rows = [int(r) for r in rows]
        for attempt in range(MISMATCH_ATTEMPTS):
            info = self.epoch()
            for row in rows:
                if not 0 <= row < info.num_rows:
                    raise ValueError(f"row {row} is outside [0, {info.num_rows})")
            try:
                return self._fetch(rows, info, batch)
            except EpochMismatch:
                # the parties may be a moment apart in following a switch or an update
                if attempt == MISMATCH_ATTEMPTS - 1:
                    raise
                time.sleep(MISMATCH_RETRY_S)
        raise AssertionError("unreachable")

    def fetch_row(self, row: int) -> bytes:
        return self.fetch_rows([row], batch=False)[0]

    def key_format_for(self, info: EpochInfo) -> str:
        """"v1" or "v2": the forced format, else v2 where both parties' /epoch list it, else v1
        (the two keys of a pair share their format); ServerError where the parties share none
        (a party that stores its matrix for v2 keys alone beside one that takes v1 alone)."""
        if self.key_format != "auto":
            return self.key_format
        for name in ("v2", "v1"):
            if all(name in formats for formats in self._key_formats):
                return name
        offers = "; ".join(f"{label} ({url}) takes {' and '.join(formats)} keys"
                           for label, url, formats in zip("AB", self.servers, self._key_formats))
        raise ServerError(f"the two servers take no key format in common: {offers}")

    def _fetch(self, rows: list[int], info: EpochInfo, batch: bool) -> list[bytes]:
        out = []
        step = self.max_batch if batch else 1
        self.last_key_format = self.key_format_for(info)
        key_format = format_by_name(self.last_key_format)
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            plans = plan_queries([r // ROWS_PER_PAGE for r in chunk], info.num_pages,
                                 info.domain_bits, key_format=key_format)
            pages = self._ask(plans, batch)
            for row, page in zip(chunk, pages):
                offset = (row % ROWS_PER_PAGE) * ROW_BYTES
                out.append(page[offset:offset + ROW_BYTES])
        return out

    def _ask(self, plans: list[PlannedQuery], batch: bool) -> list[bytes]:
        """Send the plans to both parties and XOR the answers: the wanted page of each plan."""
        # Both parties work at the same time: the latency is the slower one, not the sum.
        futures = [self._pool.submit(self._ask_party, side, plans, batch) for side in (0, 1)]
        (epoch_a, state_a, halves_a), (epoch_b, state_b, halves_b) = [f.result() for f in futures]
        if epoch_a != epoch_b:
            raise EpochMismatch(
                f"the servers answered from different epochs: {epoch_a} and {epoch_b}"
            )
        if state_a is not None and state_b is not None and state_a != state_b:
            described = [f"{name} ({base}) epoch {epoch_a} with {updates} row update"
                         f"{'' if updates == 1 else 's'} (digest {digest})"
                         for name, base, (updates, digest) in zip("AB", self.servers,
                                                                 (state_a, state_b))]
            raise StateMismatch(f"the servers answered from different states: {described[0]}, "
                                f"{described[1]}; their answers cannot be combined")
        return [_xor(a, b) for a, b in zip(halves_a, halves_b)]

    # -- encodings (docs/PROTOCOL.md section 5.3) -----------------------------------------------
    @property
    def last_encodings(self) -> tuple:
        """(party A's, party B's) encoding of the last query request; None before any."""
        return tuple(self._used)

    def encoding_for(self, side: int) -> str:
        """"json" or "binary": the forced encoding, else binary where the party advertises it."""
        if self.encoding != "auto":
            return self.encoding
        return "binary" if "binary" in self._advertised[side] else "json"

    def _ask_party(self, side: int, plans: list[PlannedQuery], batch: bool):
        """(epoch_id, served state, the answer at each plan's target slot) from one party, in its
        encoding; the state is (updates, digest) from the answer's headers, None where a server
        does not send it."""
        base = self.servers[side]
        path = "/query/page/gpu/batch" if batch else "/query/page/gpu"
        keys = [plan.keys_b if side else plan.keys_a for plan in plans]
        encoding = self.encoding_for(side)
        self._used[side] = encoding  # one item per party's thread: no lost update
        if encoding == "binary":
            body = b"".join(_key_bytes(key) for query in keys for key in query)
            epoch_id, state, payload = self._call_binary(base, path, body, len(plans))
            size = KEYS_PER_QUERY * PAGE_BYTES
            return epoch_id, state, [
                payload[i * size + plan.target_slot * PAGE_BYTES:][:PAGE_BYTES]
                for i, plan in enumerate(plans)
            ]
        as_hex = [[_key_bytes(key).hex() for key in query] for query in keys]
        if batch:
            reply, headers = self._request(base, path, {"queries": [{"keys": q} for q in as_hex]})
            results = reply.get("results")
            if not isinstance(results, list) or len(results) != len(plans):
                raise ServerError(f"{base}: expected {len(plans)} results, got {results!r:.80}")
            answers = [r.get("pages") if isinstance(r, dict) else None for r in results]
        else:
            reply, headers = self._request(base, path, {"keys": as_hex[0]})
            answers = [reply.get("pages")]
        halves = []
        for index, (plan, got) in enumerate(zip(plans, answers)):
            if not isinstance(got, list) or len(got) != KEYS_PER_QUERY:
                raise ServerError(f"{base}: query {index}: expected {KEYS_PER_QUERY} pages")
            halves.append(_unhex(got[plan.target_slot], f"{base}: query {index}"))
        return reply.get("epoch_id"), _served_state(headers), halves

    def _call_binary(self, base: str, path: str, body: bytes, queries: int):
        """POST raw keys, read raw answers: (epoch_id, served state, queries x 3 x 4096 bytes)."""
        url = base + path
        request = urllib.request.Request(
            url, data=body, method="POST",
            headers={"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM},
        )
        payload, headers = self._open(request, url)
        if headers.get_content_type() != OCTET_STREAM:
            raise ServerError(f"{url}: expected {OCTET_STREAM} answers, got "
                              f"{headers.get_content_type()}")
        expected = queries * KEYS_PER_QUERY * PAGE_BYTES
        if len(payload) != expected:
            raise ServerError(f"{url}: expected {expected} bytes of answers, got {len(payload)}")
        try:
            return int(headers.get(EPOCH_HEADER, "")), _served_state(headers), payload
        except ValueError:
            raise ServerError(f"{url}: expected the epoch in {EPOCH_HEADER}, got "
                              f"{headers.get(EPOCH_HEADER)!r}") from None

    # -- bulk jobs (docs/CLIENT.md): one job per party, resumable through a state file ----------
    def fetch_rows_bulk(self, rows: Sequence[int], tokens: Sequence[Optional[str]] = (None, None),
                        state_path=None, progress: Optional[Callable] = None,
                        poll_interval: float = 2.0) -> list[bytes]:
        """The 256-byte rows, through one bulk job at each party; see iter_rows_bulk."""
        return [data for _, data in self.iter_rows_bulk(rows, tokens, state_path, progress,
                                                        poll_interval)]

    def iter_rows_bulk(self, rows: Sequence[int], tokens: Sequence[Optional[str]] = (None, None),
                       state_path=None, progress: Optional[Callable] = None,
                       poll_interval: float = 2.0) -> Iterator[tuple[int, bytes]]:
        """(row, 256 bytes) in the order asked, from one bulk job at each party.

        `tokens` are the parties' DRF tokens (default: $MORPHO_TOKEN_A, $MORPHO_TOKEN_B). With a
        `state_path`, the plan (pages and key seeds) and each job id are written there before
        and after each submission, so a rerun after a crash resumes the same jobs; the file is
        removed once every row was read. `progress(job_a, job_b)` gets each polled job body.
        Answers of one query from two different epochs are refused (EpochMismatch).
        """
        rows = [int(r) for r in rows]
        if not rows:
            raise ValueError("expected at least one row")
        tokens = _bulk_tokens(tokens)
        path = Path(state_path) if state_path is not None else None
        state = None
        if path is not None and path.exists():
            state = BulkState.load(path)
            state.check_resumes(self.servers, rows, path)
        if state is None or None in state.jobs:
            info = self.epoch()
            # bulk jobs take v1 keys (PROTOCOL 5.5): a party that takes v2 keys alone would refuse
            # its half after the other party had started a job nobody reads
            v2_only = [url for url, formats in zip(self.servers, self._key_formats) if "v1" not in formats]
            if v2_only:
                raise ServerError(f"bulk jobs take v1 keys and {' and '.join(v2_only)} takes v2 keys only; "
                                  f"fetch these rows as batch queries instead")
            for row in rows:
                if not 0 <= row < info.num_rows:
                    raise ValueError(f"row {row} is outside [0, {info.num_rows})")
            if state is None:
                state = BulkState.plan(self.servers, info.epoch_id, info.num_pages,
                                       info.domain_bits, rows, [r // ROWS_PER_PAGE for r in rows])
                if path is not None:
                    state.save(path)
            elif info.domain_bits != state.domain_bits:
                raise StateError(
                    f"{path}: its keys are for domain_bits {state.domain_bits}, the parties now "
                    f"serve domain_bits {info.domain_bits}; remove it to plan the fetch anew"
                )
        for side, base in enumerate(self.servers):
            if state.jobs[side] is None:
                state.jobs[side] = self._bulk_submit(base, tokens[side], state, side)
                if path is not None:
                    state.save(path)
        self._bulk_wait(state, tokens, progress, poll_interval, path)
        yield from self._bulk_rows(state, tokens, path)
        if path is not None:
            path.unlink(missing_ok=True)

    def _bulk_open(self, base: str, path: str, token: str, data=None, method: str = "GET",
                   headers: Optional[dict] = None):
        url = base + path
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Token {token}", "Accept": f"application/json, {NDJSON}",
            **(headers or {})})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            try:
                detail = json.loads(text).get("detail", text)
            except (ValueError, AttributeError):
                detail = text
            raise ServerError(f"{url}: HTTP {exc.code}: {detail}", exc.code, text) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"{url}: cannot reach the server ({exc})") from None

    def _bulk_json(self, base: str, path: str, token: str, **kwargs) -> dict:
        with self._bulk_open(base, path, token, **kwargs) as response:
            try:
                return json.loads(response.read())
            except ValueError:
                raise ServerError(f"{base}{path}: the response is not JSON") from None

    def _bulk_submit(self, base: str, token: str, state: BulkState, side: int) -> str:
        """POST party `side`'s keys as an NDJSON body streamed as it is made; the job id."""
        job = self._bulk_json(base, "/bulk/jobs", token, data=state.ndjson_lines(side),
                              method="POST", headers={"Content-Type": NDJSON,
                                                      "Content-Length": str(state.ndjson_length())})
        if not isinstance(job, dict) or not isinstance(job.get("id"), (str, int)):
            raise ServerError(f"{base}/bulk/jobs: expected a job with an id, got {job!r:.80}")
        return str(job["id"])

    def _bulk_wait(self, state: BulkState, tokens, progress, poll_interval: float,
                   path: Optional[Path]) -> None:
        """Poll both jobs until both are done; a failed or cancelled job ends the fetch."""
        while True:
            jobs = [self._bulk_json(base, f"/bulk/jobs/{job_id}", token)
                    for base, job_id, token in zip(self.servers, state.jobs, tokens)]
            if progress is not None:
                progress(*jobs)
            for base, job in zip(self.servers, jobs):
                if job.get("status") in ("failed", "cancelled"):
                    again = f"; remove {path} to submit new jobs" if path is not None else ""
                    raise ServerError(f"{base}: bulk job {job.get('id')} is {job['status']} "
                                      f"({job.get('errors')!r:.200}){again}")
            if all(job.get("status") == "done" for job in jobs):
                return
            time.sleep(poll_interval)

    def _bulk_rows(self, state: BulkState, tokens,
                   path: Optional[Path]) -> Iterator[tuple[int, bytes]]:
        """Both jobs' NDJSON results read side by side: XOR of the row's page, line by line."""
        streams = [self._bulk_open(base, f"/bulk/jobs/{job_id}/results", token)
                   for base, job_id, token in zip(self.servers, state.jobs, tokens)]
        try:
            lines = zip(*(iter(stream.readline, b"") for stream in streams))
            count = 0
            for index, (row, slot, raw) in enumerate(zip(state.rows, state.slots.tolist(), lines)):
                got = []
                for text, base in zip(raw, self.servers):
                    try:
                        got.append(parse_result_line(text, index, PAGE_BYTES))
                    except ValueError as exc:
                        raise ServerError(f"{base}: {exc}") from None
                if got[0]["epoch_id"] != got[1]["epoch_id"]:
                    again = f"; remove {path} to submit new jobs" if path is not None else ""
                    raise EpochMismatch(
                        f"query {index} (row {row}) was answered from epoch {got[0]['epoch_id']} "
                        f"by A and epoch {got[1]['epoch_id']} by B: the jobs ran across an epoch "
                        f"switch and their answers cannot be combined{again}"
                    )
                offset = 2 + 2 * (row % ROWS_PER_PAGE) * ROW_BYTES  # past "0x", in hex digits
                halves = [bytes.fromhex(g["pages"][slot][offset:offset + 2 * ROW_BYTES])
                          for g in got]
                count += 1
                yield row, _xor(*halves)
            if count != len(state.rows):
                raise ServerError(f"expected {len(state.rows)} result lines from each party, "
                                  f"got {count}")
        finally:
            for stream in streams:
                stream.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "PirClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bulk_tokens(tokens: Sequence[Optional[str]]) -> tuple[str, str]:
    chosen = tuple(token or os.environ.get(env, "") for token, env in zip(tokens, TOKEN_ENV))
    missing = [party for party, token in zip("AB", chosen) if not token]
    if missing:
        raise PirError(
            f"bulk jobs need a DRF token for each party; none for {' and '.join(missing)}: "
            f"pass --token-a/--token-b or set {TOKEN_ENV[0]}/{TOKEN_ENV[1]} "
            "(`make superuser` prints one per party)"
        )
    return chosen


def _answered(job: dict):
    """Queries a job has answered, launch by launch (its `progress`), else as stored."""
    return (job.get("progress") or {}).get("answered", job.get("answered"))


def _print_progress(job_a: dict, job_b: dict) -> None:
    print("  ".join(f"{name}: job {job.get('id')} {job.get('status')} "
                    f"{_answered(job)}/{job.get('total')}"
                    for name, job in (("A", job_a), ("B", job_b))), file=sys.stderr, flush=True)


def add_bulk_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bulk jobs (docs/CLIENT.md: Bulk jobs)")
    group.add_argument("--bulk", metavar="FILE",
                       help="fetch the rows listed in FILE, one per line, through one bulk job "
                            "per party; rerun the same command to resume after a crash")
    group.add_argument("--out", help="write the rows there (row N: 0x...) instead of stdout")
    group.add_argument("--state", help="state file of the fetch (default FILE.state.json): the "
                                       "planned keys' seeds and each party's job id")
    group.add_argument("--token-a", help=f"party A's DRF token (default ${TOKEN_ENV[0]})")
    group.add_argument("--token-b", help=f"party B's DRF token (default ${TOKEN_ENV[1]})")
    group.add_argument("--poll", type=float, default=2.0, help="seconds between progress polls")


def bulk_main(args, client: PirClient, out: Callable[[str], None]) -> int:
    """`--bulk FILE`: every row of FILE through one bulk job per party, to --out or stdout."""
    rows = read_rows_file(args.bulk)
    state = args.state or f"{args.bulk}.state.json"
    last = {}

    def progress(job_a, job_b):
        figures = [(j.get("status"), _answered(j)) for j in (job_a, job_b)]
        if figures != last.get("figures"):
            last["figures"] = figures
            _print_progress(job_a, job_b)

    results = client.iter_rows_bulk(rows, (args.token_a, args.token_b), state, progress,
                                    args.poll)
    try:
        if args.out is None:
            for row, data in results:
                out(f"row {row}: 0x{data.hex()}")
            return 0
        # Written beside --out and renamed at the end: a crash never leaves a partial file there.
        target = Path(args.out)
        tmp = target.with_name(target.name + ".partial")
        with open(tmp, "w") as fh:
            for row, data in results:
                fh.write(f"row {row}: 0x{data.hex()}\n")
        os.replace(tmp, target)
    except KeyboardInterrupt:
        print(f"interrupted: the jobs go on; run the same command again to resume ({state})",
              file=sys.stderr)
        return 130
    print(f"wrote {len(rows)} rows to {target}", file=sys.stderr)
    return 0


def describe_encodings(client: PirClient) -> str:
    """`encoding: binary, keys: v2`, or each party's encoding when they differ (the -v line)."""
    a, b = client.last_encodings
    keys = f"keys: {client.last_key_format} (requested {client.key_format})"
    if a == b:
        return f"encoding: {a} (requested {client.encoding}), {keys}"
    return f"encoding: {a} with A, {b} with B (requested {client.encoding}), {keys}"


def main(argv: Optional[Sequence[str]] = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m queries.client",
        description="Fetch rows privately from two PIR servers and print them as hex.",
    )
    parser.add_argument("--server-a", required=True, help="base URL of party A, e.g. http://127.0.0.1:8001")
    parser.add_argument("--server-b", required=True, help="base URL of party B, e.g. http://127.0.0.1:8002")
    parser.add_argument("--row", type=int, action="append",
                        help="row to fetch (256 bytes); repeat for several")
    parser.add_argument("--batch", action="store_true",
                        help=f"send the rows through the batch endpoint, {MAX_BATCH_QUERIES} "
                             "per request")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request")
    parser.add_argument("--encoding", choices=ENCODINGS, default="auto",
                        help="wire encoding of the queries: binary where the server advertises "
                        "it (auto, the default), or force json or binary")
    parser.add_argument("--key-format", choices=KEY_FORMATS, default="auto",
                        help="DPF key format: v2 (docs/PROTOCOL.md section 3.1, cheaper for the "
                        "servers) where both servers advertise it (auto, the default), or force "
                        "v1 or v2; bulk jobs always use v1")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="say on stderr which encoding each party was spoken to in, and "
                        "which key format")
    add_bulk_arguments(parser)
    args = parser.parse_args(argv)
    if (args.row is None) == (args.bulk is None):
        parser.error("give the rows with --row (repeatable) or --bulk FILE, one of the two")
    try:
        with PirClient(args.server_a, args.server_b, timeout=args.timeout,
                       encoding=args.encoding, key_format=args.key_format) as client:
            if args.bulk is not None:
                if args.verbose:
                    print("bulk jobs: NDJSON up and down, keys: v1 (bulk jobs take v1 keys)",
                          file=sys.stderr)
                return bulk_main(args, client, out)
            rows = client.fetch_rows(args.row, batch=args.batch)
            if args.verbose:
                print(describe_encodings(client), file=sys.stderr)
    except (PirError, ValueError, OSError) as exc:  # OSError: a rows file or --out unusable
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for row, data in zip(args.row, rows):
        out(f"row {row}: 0x{data.hex()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

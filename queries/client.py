"""The two-server PIR client: fetch rows privately from parties A and B (no Django needed)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from gpu_engine.dpf import gen_keys

PAGE_BYTES = 4096
ROW_BYTES = 256
ROWS_PER_PAGE = 16
KEYS_PER_QUERY = 3
MAX_BATCH = 32  # queries per batch request, docs/PROTOCOL.md section 5
OCTET_STREAM = "application/octet-stream"  # the binary encoding (docs/PROTOCOL.md section 5.3)
EPOCH_HEADER = "X-Morpho-Epoch-Id"
ENCODINGS = ("auto", "json", "binary")  # auto: binary where /epoch advertises it, else JSON


class PirError(Exception):
    """The client could not fetch what was asked; the message says why."""


class EpochMismatch(PirError):
    """The two parties serve different epochs or shapes; their answers cannot be combined."""


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
            info = _with_encodings(info, body.get("encodings", ["json"]))
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


def plan_query(page: int, num_pages: int, domain_bits: int,
               rand: Optional[secrets.SystemRandom] = None) -> PlannedQuery:
    """Key pairs for `page` and two other pages drawn at random, in random order."""
    if not 0 <= page < num_pages:
        raise ValueError(f"page {page} is outside [0, {num_pages})")
    rand = rand or secrets.SystemRandom()
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
    pairs = [gen_keys(p, domain_bits) for p in pages]
    return PlannedQuery(
        pages=tuple(pages),
        target_slot=pages.index(page),
        keys_a=tuple(k0.to_bytes().hex() for k0, _ in pairs),
        keys_b=tuple(k1.to_bytes().hex() for _, k1 in pairs),
    )


def _unhex(text, what: str) -> bytes:
    if not isinstance(text, str):
        raise ServerError(f"{what}: expected a hex string, got {type(text).__name__}")
    digits = text[2:] if text[:2] in ("0x", "0X") else text
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raise ServerError(f"{what}: not hex") from None
    if len(raw) != PAGE_BYTES:
        raise ServerError(f"{what}: expected {PAGE_BYTES} bytes, got {len(raw)}")
    return raw


def _with_encodings(info: EpochInfo, encodings) -> EpochInfo:
    # A server older than the binary encoding does not list its encodings: it speaks JSON.
    if not isinstance(encodings, list) or not all(isinstance(e, str) for e in encodings):
        raise TypeError(f"encodings: expected an array of strings, got {encodings!r:.60}")
    return dataclasses.replace(info, encodings=tuple(encodings))


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


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


class PirClient:
    """Fetches rows from two non-colluding parties; each sees only pseudorandom keys."""

    def __init__(self, server_a: str, server_b: str, timeout: float = 120.0,
                 max_batch: int = MAX_BATCH, encoding: str = "auto") -> None:
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH}, got {max_batch}")
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        self.encoding = encoding
        self._advertised: tuple = (("json",), ("json",))  # per party, from its /epoch
        self._used: list = [None, None]  # per party, the encoding of its last query request
        self.servers = (server_a.rstrip("/"), server_b.rstrip("/"))
        self.timeout = timeout
        self.max_batch = max_batch
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pir-client")

    # -- transport ----------------------------------------------------------------------------
    def _call(self, base: str, path: str, body: Optional[dict] = None) -> dict:
        url = base + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            url, data=data, method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            try:
                detail = json.loads(text).get("detail", text)
            except (ValueError, AttributeError):
                detail = text
            retry = exc.headers.get("Retry-After")
            hint = f" (retry after {retry} s)" if retry else ""
            raise ServerError(f"{url}: HTTP {exc.code}: {detail}{hint}", exc.code, text) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"{url}: cannot reach the server ({exc})") from None
        try:
            return json.loads(payload)
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
        for attempt in range(2):  # one retry when the parties answered from different epochs
            info = self.epoch()
            for row in rows:
                if not 0 <= row < info.num_rows:
                    raise ValueError(f"row {row} is outside [0, {info.num_rows})")
            try:
                return self._fetch(rows, info, batch)
            except EpochMismatch:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def fetch_row(self, row: int) -> bytes:
        return self.fetch_rows([row], batch=False)[0]

    def _fetch(self, rows: list[int], info: EpochInfo, batch: bool) -> list[bytes]:
        out = []
        step = self.max_batch if batch else 1
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            plans = [plan_query(r // ROWS_PER_PAGE, info.num_pages, info.domain_bits)
                     for r in chunk]
            pages = self._ask(plans, batch)
            for row, page in zip(chunk, pages):
                offset = (row % ROWS_PER_PAGE) * ROW_BYTES
                out.append(page[offset:offset + ROW_BYTES])
        return out

    def _ask(self, plans: list[PlannedQuery], batch: bool) -> list[bytes]:
        """Send the plans to both parties and XOR the answers: the wanted page of each plan."""
        # Both parties work at the same time: the latency is the slower one, not the sum.
        futures = [self._pool.submit(self._ask_party, side, plans, batch) for side in (0, 1)]
        (epoch_a, halves_a), (epoch_b, halves_b) = [future.result() for future in futures]
        if epoch_a != epoch_b:
            raise EpochMismatch(
                f"the servers answered from different epochs: {epoch_a} and {epoch_b}"
            )
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
        """(epoch_id, the answer at each plan's target slot) from one party, in its encoding."""
        base = self.servers[side]
        path = "/query/page/gpu/batch" if batch else "/query/page/gpu"
        keys = [plan.keys_b if side else plan.keys_a for plan in plans]
        encoding = self.encoding_for(side)
        self._used[side] = encoding  # one item per party's thread: no lost update
        if encoding == "binary":
            body = b"".join(_key_bytes(key) for query in keys for key in query)
            epoch_id, payload = self._call_binary(base, path, body, len(plans))
            size = KEYS_PER_QUERY * PAGE_BYTES
            return epoch_id, [
                payload[i * size + plan.target_slot * PAGE_BYTES:][:PAGE_BYTES]
                for i, plan in enumerate(plans)
            ]
        as_hex = [[_key_bytes(key).hex() for key in query] for query in keys]
        if batch:
            reply = self._call(base, path, {"queries": [{"keys": q} for q in as_hex]})
            results = reply.get("results")
            if not isinstance(results, list) or len(results) != len(plans):
                raise ServerError(f"{base}: expected {len(plans)} results, got {results!r:.80}")
            answers = [r.get("pages") if isinstance(r, dict) else None for r in results]
        else:
            reply = self._call(base, path, {"keys": as_hex[0]})
            answers = [reply.get("pages")]
        halves = []
        for index, (plan, got) in enumerate(zip(plans, answers)):
            if not isinstance(got, list) or len(got) != KEYS_PER_QUERY:
                raise ServerError(f"{base}: query {index}: expected {KEYS_PER_QUERY} pages")
            halves.append(_unhex(got[plan.target_slot], f"{base}: query {index}"))
        return reply.get("epoch_id"), halves

    def _call_binary(self, base: str, path: str, body: bytes, queries: int) -> tuple[int, bytes]:
        """POST raw keys, read raw answers: (epoch_id, queries x 3 x 4096 bytes)."""
        url = base + path
        request = urllib.request.Request(
            url, data=body, method="POST",
            headers={"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload, headers = response.read(), response.headers
        except urllib.error.HTTPError as exc:
            raise _http_error(url, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"{url}: cannot reach the server ({exc})") from None
        if headers.get_content_type() != OCTET_STREAM:
            raise ServerError(f"{url}: expected {OCTET_STREAM} answers, got "
                              f"{headers.get_content_type()}")
        expected = queries * KEYS_PER_QUERY * PAGE_BYTES
        if len(payload) != expected:
            raise ServerError(f"{url}: expected {expected} bytes of answers, got {len(payload)}")
        try:
            return int(headers.get(EPOCH_HEADER, "")), payload
        except ValueError:
            raise ServerError(f"{url}: expected the epoch in {EPOCH_HEADER}, got "
                              f"{headers.get(EPOCH_HEADER)!r}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "PirClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def describe_encodings(client: PirClient) -> str:
    """`encoding: binary`, or each party's when they differ (the -v line)."""
    a, b = client.last_encodings
    if a == b:
        return f"encoding: {a} (requested {client.encoding})"
    return f"encoding: {a} with A, {b} with B (requested {client.encoding})"


def main(argv: Optional[Sequence[str]] = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m queries.client",
        description="Fetch rows privately from two PIR servers and print them as hex.",
    )
    parser.add_argument("--server-a", required=True, help="base URL of party A, e.g. http://127.0.0.1:8001")
    parser.add_argument("--server-b", required=True, help="base URL of party B, e.g. http://127.0.0.1:8002")
    parser.add_argument("--row", type=int, action="append", required=True,
                        help="row to fetch (256 bytes); repeat for several")
    parser.add_argument("--batch", action="store_true",
                        help=f"send the rows through the batch endpoint, {MAX_BATCH} per request")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request")
    parser.add_argument("--encoding", choices=ENCODINGS, default="auto",
                        help="wire encoding of the queries: binary where the server advertises "
                        "it (auto, the default), or force json or binary")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="say on stderr which encoding each party was spoken to in")
    args = parser.parse_args(argv)
    try:
        with PirClient(args.server_a, args.server_b, timeout=args.timeout,
                       encoding=args.encoding) as client:
            rows = client.fetch_rows(args.row, batch=args.batch)
            if args.verbose:
                print(describe_encodings(client), file=sys.stderr)
    except (PirError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for row, data in zip(args.row, rows):
        out(f"row {row}: 0x{data.hex()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the sync and asyncio clients share: errors, /epoch, party URLs, and reading answers."""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import urllib.parse
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from morpho_pir.http import (ANSWER_BYTES, DIGEST_HEADER, EPOCH_HEADER, OCTET_STREAM,
                             UPDATES_HEADER)
from morpho_pir.protocol import (KEY_FORMAT_NAMES, KEYS_PER_QUERY, PAGE_BYTES, ROW_BYTES,
                                 ROWS_PER_PAGE, HexError, parse_hex)

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

    def __init__(self, message: str, status: Optional[int] = None, body=None,
                 retry_after: Optional[float] = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.retry_after = retry_after


class SameServer(PirError, ValueError):
    """Both party URLs name one server: it would see both keys of every pair."""


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
    # a records epoch's table parameters (docs/PROTOCOL.md section 9.4), as /epoch gives them
    records: Optional[dict] = dataclasses.field(default=None, compare=False)

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
                records=body.get("records"),
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

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_pages, self.domain_bits, self.num_rows


def _with_encodings(info: EpochInfo, encodings, key_formats) -> EpochInfo:
    # A server older than the binary encoding does not list its encodings: it speaks JSON; one
    # older than v2 keys does not list its key formats: it takes v1.
    for name, value in (("encodings", encodings), ("key_formats", key_formats)):
        if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
            raise TypeError(f"{name}: expected an array of strings, got {value!r:.60}")
    return dataclasses.replace(info, encodings=tuple(encodings), key_formats=tuple(key_formats))


def agreed_epoch(servers: Sequence[str], infos: Sequence[EpochInfo]) -> EpochInfo:
    """Party A's epoch where both serve the same epoch and shape; EpochMismatch naming both."""
    a, b = infos
    if a.epoch_id != b.epoch_id:
        raise EpochMismatch(
            f"the servers serve different epochs: A ({servers[0]}) epoch {a.epoch_id}, "
            f"B ({servers[1]}) epoch {b.epoch_id}; their answers cannot be combined"
        )
    if a.shape != b.shape:
        raise EpochMismatch(
            f"the servers serve different shapes in epoch {a.epoch_id}: A has {a.num_pages} "
            f"pages at domain_bits {a.domain_bits}, B has {b.num_pages} pages at domain_bits "
            f"{b.domain_bits}"
        )
    return a


def choose_key_format(requested: str, servers: Sequence[str], offered: Sequence) -> str:
    """"v1" or "v2": the forced format, else v2 where both parties' /epoch list it, else v1
    (the two keys of a pair share their format); ServerError where the parties share none."""
    if requested != "auto":
        return requested
    for name in ("v2", "v1"):
        if all(name in formats for formats in offered):
            return name
    offers = "; ".join(f"{label} ({url}) takes {' and '.join(formats)} keys"
                       for label, url, formats in zip("AB", servers, offered))
    raise ServerError(f"the two servers take no key format in common: {offers}")


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


# -- reading answers -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Half:
    """One party's answer to one request: its epoch, served state and the wanted pages."""

    epoch_id: Optional[int]
    state: Optional[tuple[int, str]]  # (rows written, digest); None where a server sends none
    pages: np.ndarray  # (Q, 4096) u8: each query's answer at its wanted slot


@dataclass(frozen=True)
class Answer:
    """Both parties' answers to one request, XORed: the wanted pages and the state they share."""

    epoch_id: int
    state: Optional[tuple[int, str]]
    pages: np.ndarray  # (Q, 4096) u8

    def rows(self, rows: np.ndarray) -> list[bytes]:
        """The 256-byte row of each query's page (`rows[i]` is on query i's page)."""
        at = np.asarray(rows) % ROWS_PER_PAGE
        picked = self.pages.reshape(-1, ROWS_PER_PAGE, ROW_BYTES)[np.arange(len(at)), at]
        raw = picked.tobytes()
        return [raw[i:i + ROW_BYTES] for i in range(0, len(raw), ROW_BYTES)]


def error_from(url: str, status: int, text: str, headers) -> ServerError:
    """A party's error status as a ServerError quoting its JSON `detail` and Retry-After."""
    try:
        detail = json.loads(text).get("detail", text)
    except (ValueError, AttributeError):
        detail = text
    retry = headers.get("Retry-After")
    try:
        retry_after = float(retry) if retry is not None else None
    except ValueError:
        retry_after = None
    hint = f" (retry after {retry} s)" if retry else ""
    return ServerError(f"{url}: HTTP {status}: {detail}{hint}", status, text, retry_after)


def served_state(headers) -> Optional[tuple[int, str]]:
    """(rows written, digest) of an answer's state headers; None where the server sends none."""
    updates, digest = headers.get(UPDATES_HEADER), headers.get(DIGEST_HEADER)
    if updates is None or digest is None:
        return None
    return int(updates), digest.lower()


def unhex_page(text, what: str) -> bytes:
    if not isinstance(text, str):
        raise ServerError(f"{what}: expected a hex string, got {type(text).__name__}")
    try:
        raw = parse_hex(text)
    except HexError:
        raise ServerError(f"{what}: not hex") from None
    if len(raw) != PAGE_BYTES:
        raise ServerError(f"{what}: expected {PAGE_BYTES} bytes, got {len(raw)}")
    return raw


def binary_half(url: str, headers, payload: bytes, slots: np.ndarray) -> Half:
    """A binary answer (docs/PROTOCOL.md section 5.3) reduced to each query's wanted page."""
    kind = headers.get("Content-Type", "").split(";")[0].strip()
    if kind != OCTET_STREAM:
        raise ServerError(f"{url}: expected {OCTET_STREAM} answers, got {kind}")
    expected = len(slots) * ANSWER_BYTES
    if len(payload) != expected:
        raise ServerError(f"{url}: expected {expected} bytes of answers, got {len(payload)}")
    try:
        epoch_id = int(headers.get(EPOCH_HEADER, ""))
    except ValueError:
        raise ServerError(f"{url}: expected the epoch in {EPOCH_HEADER}, got "
                          f"{headers.get(EPOCH_HEADER)!r}") from None
    answers = np.frombuffer(payload, dtype=np.uint8).reshape(len(slots), KEYS_PER_QUERY, PAGE_BYTES)
    return Half(epoch_id, served_state(headers), answers[np.arange(len(slots)), slots])


def json_half(url: str, headers, reply, slots: np.ndarray, batch: bool) -> Half:
    """A JSON answer (one query, or a batch's `results`) reduced to each query's wanted page."""
    if not isinstance(reply, dict):
        raise ServerError(f"{url}: expected a JSON object, got {reply!r:.80}")
    if batch:
        results = reply.get("results")
        if not isinstance(results, list) or len(results) != len(slots):
            raise ServerError(f"{url}: expected {len(slots)} results, got {results!r:.80}")
        answers = [r.get("pages") if isinstance(r, dict) else None for r in results]
    else:
        answers = [reply.get("pages")]
    pages = np.empty((len(slots), PAGE_BYTES), dtype=np.uint8)
    for index, (slot, got) in enumerate(zip(slots.tolist(), answers)):
        if not isinstance(got, list) or len(got) != KEYS_PER_QUERY:
            raise ServerError(f"{url}: query {index}: expected {KEYS_PER_QUERY} pages")
        pages[index] = np.frombuffer(unhex_page(got[slot], f"{url}: query {index}"), np.uint8)
    return Half(reply.get("epoch_id"), served_state(headers), pages)


def check_same_state(servers: Sequence[str], a: Half, b: Half) -> None:
    """EpochMismatch or StateMismatch unless both halves come from one epoch and state."""
    if a.epoch_id != b.epoch_id:
        raise EpochMismatch(
            f"the servers answered from different epochs: {a.epoch_id} and {b.epoch_id}"
        )
    if a.state is not None and b.state is not None and a.state != b.state:
        described = [f"{name} ({base}) epoch {a.epoch_id} with {updates} row update"
                     f"{'' if updates == 1 else 's'} (digest {digest})"
                     for name, base, (updates, digest) in zip("AB", servers, (a.state, b.state))]
        raise StateMismatch(f"the servers answered from different states: {described[0]}, "
                            f"{described[1]}; their answers cannot be combined")


def combine(servers: Sequence[str], a: Half, b: Half) -> Answer:
    """XOR of two halves of one state: the wanted pages (docs/PROTOCOL.md section 4)."""
    check_same_state(servers, a, b)
    return Answer(int(a.epoch_id), a.state, np.bitwise_xor(a.pages, b.pages))

"""The engine server's binary protocol over ZeroMQ: message kinds, frame layouts, pack and unpack.

A client (DEALER) sends multipart messages `[kind, request_id, ...]`; the server (ROUTER) answers
each with `[kind, request_id, ...]`. Keys and answers travel as raw bytes: no hex, no JSON on the
query path. Control messages (health, metrics, epoch switches) carry small JSON bodies.

| kind | direction | frames after [kind, id] |
|---|---|---|
| QUERY  | client -> server | header `<BBBI` (lane index, domain_bits, keys per query, queries), keys |
| ANSWER | server -> client | header `<QIQ32s` (epoch_id, keys, rows written, their digest: the served state), answers (4096 bytes per key, in order) |
| ERROR  | server -> client | JSON {"kind": overloaded/unavailable/invalid, "reason", "retry_after"} |
| CONTROL | client -> server | JSON {"op", "args"} |
| RESULT | server -> client | JSON {"result"} or {"error", "kind"} |
| PING / PONG | both | - / JSON status: epoch, state, running, warming, failure, policies |
"""
from __future__ import annotations

import json
import struct
import threading
from dataclasses import asdict
from typing import Any, Dict, Mapping, Tuple

import zmq

from morpho_pir.protocol import PAGE_BYTES
from gpu_engine.scheduler import LANES, LanePolicy
from morpho_pir.state import ServedState

QUERY = b"Q"
ANSWER = b"A"
ERROR = b"E"
CONTROL = b"C"
RESULT = b"R"
PING = b"P"
PONG = b"O"

_QUERY_HEADER = struct.Struct("<BBBI")
_ANSWER_HEADER = struct.Struct("<QIQ32s")
_ID = struct.Struct("<Q")

# ERROR kinds, mapped to the engine's exceptions on the client side
OVERLOADED, UNAVAILABLE, INVALID = "overloaded", "unavailable", "invalid"


class WireError(ValueError):
    """A message that does not follow this protocol (a bug or a foreign peer), not a user error."""


def readable(sock: zmq.Socket) -> bool:
    """Whether a message waits on `sock`: asked, not tried, since a NOBLOCK read of an empty
    socket raises zmq.Again, and the I/O loops would build and catch one on every pass."""
    return bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)


class Waker:
    """How other threads tell an I/O thread that its outbox has frames: an inproc PUSH to the
    PULL socket the I/O thread polls. One wake-up stands for every frame queued until the I/O
    thread takes it (`woken`, before it empties the outbox), so a busy outbox costs one message
    per pass of the I/O loop, not one per frame."""

    def __init__(self, context: zmq.Context, url: str) -> None:
        self._context, self._url = context, url
        self._lock = threading.Lock()
        self._push: zmq.Socket | None = None  # made by the first waker: PUSH connects after the bind
        self._pending = False  # a wake-up is on its way and not yet taken

    def bind(self) -> zmq.Socket:
        """The PULL socket to poll (in the I/O thread)."""
        pull = self._context.socket(zmq.PULL)
        pull.bind(self._url)
        return pull

    def wake(self) -> None:
        """Call after queueing frames."""
        with self._lock:
            if self._pending:
                return
            if self._push is None:
                self._push = self._context.socket(zmq.PUSH)
                self._push.connect(self._url)
            self._push.send(b"", zmq.NOBLOCK)
            self._pending = True

    def woken(self, pull: zmq.Socket) -> None:
        """Take the wake-ups (in the I/O thread, then empty the outbox): frames queued from here
        on wake it again."""
        while readable(pull):
            pull.recv()
        with self._lock:
            self._pending = False

    def close(self) -> None:
        with self._lock:
            if self._push is not None:
                self._push.close(0)
                self._push = None


def pack_id(request_id: int) -> bytes:
    return _ID.pack(request_id)


def unpack_id(frame: bytes) -> int:
    if len(frame) != _ID.size:
        raise WireError(f"request id frame is {len(frame)} bytes, expected {_ID.size}")
    return _ID.unpack(frame)[0]


def lane_index(lane: str) -> int:
    """The lane's number on the wire; ValueError for a lane the engine does not have."""
    if lane not in LANES:
        raise ValueError(f"unknown lane {lane!r}, expected one of {', '.join(LANES)}")
    return LANES.index(lane)


def pack_query(lane: str, domain_bits: int, keys_per_query: int, queries: int) -> bytes:
    return _QUERY_HEADER.pack(lane_index(lane), domain_bits, keys_per_query, queries)


def unpack_query(header: bytes, keys_len: int, key_length) -> Tuple[str, int, Tuple[int, ...]]:
    """(lane, domain_bits, keys per query) of a QUERY, checked against the key bytes' length."""
    if len(header) != _QUERY_HEADER.size:
        raise WireError(f"query header is {len(header)} bytes, expected {_QUERY_HEADER.size}")
    lane_index, domain_bits, per_query, queries = _QUERY_HEADER.unpack(header)
    if lane_index >= len(LANES) or per_query < 1 or queries < 1:
        raise WireError(f"query header names lane {lane_index}, {per_query} keys per query, "
                        f"{queries} queries")
    expected = queries * per_query * key_length(domain_bits)
    if keys_len != expected:
        raise WireError(f"{keys_len} key bytes, the header promises {queries} x {per_query} keys "
                        f"of {key_length(domain_bits)} bytes = {expected}")
    return LANES[lane_index], domain_bits, (per_query,) * queries


def pack_answer(state: ServedState, keys: int) -> bytes:
    return _ANSWER_HEADER.pack(state.epoch_id, keys, state.updates, state.digest)


def unpack_answer(header: bytes, answers_len: int) -> Tuple[ServedState, int]:
    epoch_id, keys, updates, digest = _ANSWER_HEADER.unpack(header)
    if answers_len != keys * PAGE_BYTES:
        raise WireError(f"{answers_len} answer bytes for {keys} keys of {PAGE_BYTES} bytes")
    return ServedState(epoch_id, updates, digest), keys


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def loads(frame) -> Any:
    return json.loads(bytes(frame))


def policies_to_json(policies: Mapping[str, LanePolicy]) -> Dict[str, dict]:
    return {lane: asdict(policy) for lane, policy in policies.items()}


def policies_from_json(data: Mapping[str, Mapping[str, Any]]) -> Dict[str, LanePolicy]:
    return {lane: LanePolicy(**fields) for lane, fields in data.items()}

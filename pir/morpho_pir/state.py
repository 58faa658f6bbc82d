"""The state an answer comes from: its epoch plus a digest of the rows written over the epoch's file.

Two parties that took the same row updates hold the same rows, whatever order or batches they
applied them in, so the digest is a set digest: the XOR over written rows of SHA-256(row index as
u64 little-endian || the row's 256 bytes). Rewriting a row takes its old term out. A client that
gets answers of two different states from the two parties must not XOR them (PROTOCOL.md).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from morpho_pir.protocol import parse_hex

DIGEST_BYTES = 32
_ROW = struct.Struct("<Q")


@dataclass(frozen=True)
class ServedState:
    """epoch_id, how many rows are written over its matrix file, and their digest."""

    epoch_id: int
    updates: int = 0
    digest: bytes = bytes(DIGEST_BYTES)

    def describe(self) -> dict:
        """The JSON form of /epoch's and every answer's `state`."""
        return {"epoch_id": self.epoch_id, "updates": self.updates, "digest": "0x" + self.digest.hex()}

    @classmethod
    def from_description(cls, data: Mapping) -> "ServedState":
        return cls(int(data["epoch_id"]), int(data["updates"]), parse_hex(data["digest"]))


def row_term(row: int, data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(_ROW.pack(row) + bytes(data)).digest(), "big")


class RowDigest:
    """The written rows of one epoch and their set digest; not thread-safe (the scheduler owns it)."""

    def __init__(self, rows: Optional[Mapping[int, bytes]] = None) -> None:
        self._terms: Dict[int, int] = {}
        self._digest = 0
        self.write(rows or {})

    def write(self, rows: Mapping[int, bytes]) -> None:
        for row, data in rows.items():
            term = row_term(row, data)
            self._digest ^= self._terms.get(row, 0) ^ term
            self._terms[row] = term

    def state(self, epoch_id: int) -> ServedState:
        return ServedState(epoch_id, len(self._terms), self._digest.to_bytes(DIGEST_BYTES, "big"))

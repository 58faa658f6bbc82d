"""The records table (docs/PROTOCOL.md section 9): key -> value records in cuckoo pages.

Every record lives in one row of one of its key's three candidate pages, chosen by a keyed,
stable hash (SHA-256) that any language can compute, so a client reads a key by querying its
three candidate pages and matching the full key in the 48 rows it gets back. Building a table
and changing it are the server's business (gpu_engine.records); this module is what both sides
need to agree on the bytes.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, parse_hex

RECORDS_VERSION = 1
# The domain separators: a records hash is never a hash of anything else this protocol makes.
PAGE_DOMAIN = b"morpho-records/v1/page"
PARAMS_DOMAIN = b"morpho-records/v1/params"
FINGERPRINT_BYTES = 16
MIN_PAGES = KEYS_PER_QUERY  # three distinct candidate pages need three pages
ROW_HEADER_BYTES = 1  # the type byte
EMPTY_TYPE = 0  # a row whose type byte is 0 holds no record (and is all zeros)
U64 = (1 << 64) - 1


class RecordsError(ValueError):
    """Bytes that break the records layout: a duplicate key, a malformed row, bad parameters."""


@dataclass(frozen=True)
class Record:
    key: bytes
    value: bytes
    type: int = 1


@dataclass(frozen=True)
class RecordsTable:
    """The parameters of one records table: all a client needs to find a key's pages and row."""

    seed: int
    num_pages: int
    key_bytes: int
    value_bytes: int
    version: int = RECORDS_VERSION

    def __post_init__(self) -> None:
        if self.version != RECORDS_VERSION:
            raise RecordsError(f"records version {self.version} is not known; expected "
                               f"{RECORDS_VERSION}")
        if not 0 <= self.seed <= U64:
            raise RecordsError(f"seed: expected an integer in 0..{U64}, got {self.seed}")
        if not MIN_PAGES <= self.num_pages <= U64:
            raise RecordsError(f"num_pages: expected at least {MIN_PAGES} (three distinct "
                               f"candidate pages), got {self.num_pages}")
        if self.key_bytes < 1 or self.value_bytes < 0 or (
                ROW_HEADER_BYTES + self.key_bytes + self.value_bytes > ROW_BYTES):
            raise RecordsError(
                f"key_bytes {self.key_bytes} and value_bytes {self.value_bytes}: expected "
                f"key_bytes >= 1, value_bytes >= 0 and 1 + key_bytes + value_bytes <= {ROW_BYTES}")

    # -- parameters -------------------------------------------------------------------------

    @property
    def fingerprint(self) -> bytes:
        """16 bytes naming these parameters: a lookup carries it, a party with others refuses."""
        packed = struct.pack("<BQQHH", self.version, self.seed, self.num_pages, self.key_bytes,
                             self.value_bytes)
        return hashlib.sha256(PARAMS_DOMAIN + packed).digest()[:FINGERPRINT_BYTES]

    @property
    def fingerprint_hex(self) -> str:
        return "0x" + self.fingerprint.hex()

    @property
    def num_rows(self) -> int:
        return self.num_pages * ROWS_PER_PAGE

    def describe(self) -> dict:
        """The JSON of /epoch's `records` and of the epoch sidecar's."""
        return {"version": self.version, "seed": self.seed, "num_pages": self.num_pages,
                "key_bytes": self.key_bytes, "value_bytes": self.value_bytes,
                "fingerprint": self.fingerprint_hex}

    @classmethod
    def from_description(cls, data: Mapping) -> "RecordsTable":
        """describe()'s JSON back; a fingerprint in it must be these parameters' own."""
        if not isinstance(data, Mapping):
            raise RecordsError(f"records: expected an object, got {type(data).__name__}")
        fields = {}
        for name in ("version", "seed", "num_pages", "key_bytes", "value_bytes"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise RecordsError(f"records.{name}: expected an integer, got {value!r}")
            fields[name] = value
        table = cls(**fields)
        given = data.get("fingerprint")
        if given is not None:
            try:
                given_bytes = parse_hex(given, FINGERPRINT_BYTES)
            except ValueError as exc:
                raise RecordsError(f"records.fingerprint: {exc}") from None
            if given_bytes != table.fingerprint:
                raise RecordsError(f"records.fingerprint: {given} is not the fingerprint of these "
                                   f"parameters ({table.fingerprint_hex})")
        return table

    # -- where a key lives -------------------------------------------------------------------

    def check_key(self, key: bytes) -> bytes:
        # bytes() of a str fails with a riddle, and of an int is that many zero bytes: a key
        # that would look up something else than the one meant
        if isinstance(key, str):
            raise TypeError(f"key: expected bytes, got the str {key[:24]!r}"
                            f"{'...' if len(key) > 24 else ''} (bytes.fromhex reads hex)")
        if isinstance(key, int):
            raise TypeError(f"key: expected bytes, got the int {key}")
        key = bytes(key)
        if len(key) != self.key_bytes:
            shown = key[:20].hex() + ("..." if len(key) > 20 else "")  # which one, of a file's
            raise RecordsError(f"key 0x{shown}: expected {self.key_bytes} bytes, got {len(key)}")
        return key

    def candidate_pages(self, key: bytes) -> tuple:
        """The key's three distinct candidate pages, in function order (section 9.1)."""
        key = self.check_key(key)
        words = [int.from_bytes(hashlib.sha256(prefix + key).digest()[:8], "little")
                 for prefix in self._prefixes()]
        return tuple(int(p) for p in distinct_pages(np.array([words], dtype=np.uint64),
                                                     self.num_pages)[0])

    def candidate_pages_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """(n, 3) int64: candidate_pages of each key, the hashes in one pass per function."""
        keys = [self.check_key(key) for key in keys]
        words = np.empty((len(keys), KEYS_PER_QUERY), dtype=np.uint64)
        for index, prefix in enumerate(self._prefixes()):
            words[:, index] = hash_words(prefix, keys)
        return distinct_pages(words, self.num_pages)

    def _prefixes(self) -> list:
        return [hash_prefix(self.seed, index) for index in range(KEYS_PER_QUERY)]

    # -- rows ---------------------------------------------------------------------------------

    def encode_row(self, key: bytes, value: bytes, record_type: int = 1) -> bytes:
        """type byte || key || value, zero-padded to 256 bytes."""
        key = self.check_key(key)
        value = bytes(value)
        if len(value) != self.value_bytes:
            raise RecordsError(f"value: expected {self.value_bytes} bytes, got {len(value)}")
        if not 1 <= record_type <= 255:
            raise RecordsError(f"type: expected an integer in 1..255 (0 marks an empty row), "
                               f"got {record_type}")
        used = ROW_HEADER_BYTES + self.key_bytes + self.value_bytes
        return bytes([record_type]) + key + value + bytes(ROW_BYTES - used)

    def decode_row(self, row: bytes) -> Optional[Record]:
        """The record a row holds, or None for an empty row; RecordsError for any other bytes."""
        if len(row) != ROW_BYTES:
            raise RecordsError(f"a row is {ROW_BYTES} bytes, got {len(row)}")
        used = ROW_HEADER_BYTES + self.key_bytes + self.value_bytes
        if row[0] == EMPTY_TYPE:
            if any(row):
                raise RecordsError("an empty row (type 0) holds non-zero bytes: not a records "
                                   "table of these parameters")
            return None
        if any(row[used:]):
            raise RecordsError(f"a row holds non-zero bytes past byte {used}: not a records table "
                               f"of these parameters")
        key_end = ROW_HEADER_BYTES + self.key_bytes
        return Record(bytes(row[ROW_HEADER_BYTES:key_end]), bytes(row[key_end:used]), row[0])

    def find(self, key: bytes, pages: Sequence[bytes]) -> Optional[Record]:
        """The record of `key` among its three candidate pages' bytes: found once -> the record,
        absent -> None, found more than once -> RecordsError (no table this layout builds)."""
        key = self.check_key(key)
        if len(pages) != KEYS_PER_QUERY:
            raise RecordsError(f"expected the key's {KEYS_PER_QUERY} candidate pages, got "
                               f"{len(pages)}")
        for page in pages:
            if len(page) != PAGE_BYTES:
                raise RecordsError(f"a page is {PAGE_BYTES} bytes, got {len(page)}")
        joined = np.frombuffer(b"".join(bytes(page) for page in pages), dtype=np.uint8)
        return self.find_many([key], joined.reshape(1, KEYS_PER_QUERY, PAGE_BYTES))[0]

    def find_many(self, keys: Sequence[bytes], pages: np.ndarray) -> list:
        """find() of each key at once: keys[i] among pages[i], an (n, 3, 4096) u8 array of its
        candidate pages. Every one of the 48 rows is checked as decode_row checks it."""
        keys = [self.check_key(key) for key in keys]
        pages = np.ascontiguousarray(pages, dtype=np.uint8)
        count = len(keys)
        if pages.shape != (count, KEYS_PER_QUERY, PAGE_BYTES):
            raise RecordsError(f"expected {count} keys' {KEYS_PER_QUERY} candidate pages of "
                               f"{PAGE_BYTES} bytes, got an array of shape {pages.shape}")
        rows = pages.reshape(count, KEYS_PER_QUERY * ROWS_PER_PAGE, ROW_BYTES)
        key_end = ROW_HEADER_BYTES + self.key_bytes
        used = key_end + self.value_bytes
        empty = rows[:, :, 0] == EMPTY_TYPE
        if rows.view(np.uint64)[empty].any():  # the few empty rows alone, 8 bytes a step
            raise RecordsError("an empty row (type 0) holds non-zero bytes: not a records "
                               "table of these parameters")
        if rows[:, :, used:].any():
            raise RecordsError(f"a row holds non-zero bytes past byte {used}: not a records table "
                               f"of these parameters")
        wanted = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(count, self.key_bytes)
        match = ~empty & (rows[:, :, ROW_HEADER_BYTES:key_end] == wanted[:, None, :]).all(axis=2)
        times = match.sum(axis=1)
        if (times > 1).any():
            twice = int(np.argmax(times > 1))
            raise RecordsError(f"key 0x{keys[twice].hex()} is in {int(times[twice])} rows of its "
                               f"candidate pages: the table is corrupt")
        picked = rows[np.arange(count), match.argmax(axis=1)]
        values = picked[:, key_end:used].tobytes()
        size = self.value_bytes
        return [Record(key, values[i * size:(i + 1) * size], int(picked[i, 0]))
                if times[i] else None for i, key in enumerate(keys)]


def hash_prefix(seed: int, index: int) -> bytes:
    """What comes before the key in function `index`'s hash input: domain, seed (u64 LE), index."""
    return PAGE_DOMAIN + struct.pack("<QB", seed, index)


def hash_words(prefix: bytes, keys: Sequence[bytes]) -> np.ndarray:
    """u64 (little-endian, the digest's first 8 bytes) of SHA-256(prefix || key) for each key."""
    sha256 = hashlib.sha256
    digests = b"".join([sha256(prefix + key).digest()[:8] for key in keys])
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def distinct_pages(words: np.ndarray, num_pages: int) -> np.ndarray:
    """(n, 3) u64 hash words -> (n, 3) int64 pages, distinct in each row (section 9.1): function
    i draws among the pages functions 0..i-1 did not take, by rank, with no retry loop."""
    if num_pages < MIN_PAGES:
        raise RecordsError(f"num_pages: expected at least {MIN_PAGES}, got {num_pages}")
    n = np.uint64(num_pages)
    p0 = (words[:, 0] % n).astype(np.int64)
    p1 = (words[:, 1] % (n - np.uint64(1))).astype(np.int64)
    p1 += p1 >= p0
    p2 = (words[:, 2] % (n - np.uint64(2))).astype(np.int64)
    low, high = np.minimum(p0, p1), np.maximum(p0, p1)
    p2 += p2 >= low
    p2 += p2 >= high
    return np.stack([p0, p1, p2], axis=1)

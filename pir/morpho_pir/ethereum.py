"""Ethereum state as records (docs/PROTOCOL.md section 9.5): accounts, storage slots, code chunks.

An Ethereum-like state is three kinds of records: accounts (address -> balance, nonce, code
hash, code size), storage (address || slot -> value) and code (code hash || chunk index -> a
chunk of bytecode), each a table of its own or all in one state table whose keys start with
their kind (what the JSON-RPC gateway reads: one epoch per pair of parties). Keccak-256
(Ethereum's, not NIST SHA3-256) is here in plain Python: code hashes are few and short, and the
protocol core imports NumPy only.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

ADDRESS_BYTES = 20
WORD_BYTES = 32
ACCOUNT_VALUE_BYTES = 32 + 8 + 32 + 4  # balance, nonce, code hash, code size
STORAGE_KEY_BYTES = ADDRESS_BYTES + WORD_BYTES
CODE_KEY_BYTES = WORD_BYTES + 4  # code hash, chunk index (u32 BE)
CODE_CHUNK_BYTES = 192  # bytecode a code record holds (the last chunk zero-padded)
MAX_CODE_BYTES = 24_576  # EIP-170's limit on deployed code
MAX_CODE_CHUNKS = -(-MAX_CODE_BYTES // CODE_CHUNK_BYTES)  # 128

# Record types (section 9.2's type byte) of the three tables.
ACCOUNT_TYPE, STORAGE_TYPE, CODE_TYPE = 1, 2, 3
# The state table: key = kind (the record type) || the kind's key zero-padded to 52 bytes; value
# = the kind's value zero-padded to 192 bytes (1 + 53 + 192 = 246 bytes of a row).
STATE_KEY_BYTES = 1 + STORAGE_KEY_BYTES
STATE_VALUE_BYTES = CODE_CHUNK_BYTES

_ROUND_CONSTANTS = [
    0x0000000000000001, 0x0000000000008082, 0x800000000000808A, 0x8000000080008000,
    0x000000000000808B, 0x0000000080000001, 0x8000000080008081, 0x8000000000008009,
    0x000000000000008A, 0x0000000000000088, 0x0000000080008009, 0x000000008000000A,
    0x000000008000808B, 0x800000000000008B, 0x8000000000008089, 0x8000000000008003,
    0x8000000000008002, 0x8000000000000080, 0x000000000000800A, 0x800000008000000A,
    0x8000000080008081, 0x8000000000008080, 0x0000000080000001, 0x8000000080008008,
]
_ROTATIONS = [[0, 36, 3, 41, 18], [1, 44, 10, 45, 2], [62, 6, 43, 15, 61],
              [28, 55, 25, 21, 56], [27, 20, 39, 8, 14]]
_MASK = (1 << 64) - 1


def _keccak_f(state: list) -> None:
    for constant in _ROUND_CONSTANTS:
        c = [state[x][0] ^ state[x][1] ^ state[x][2] ^ state[x][3] ^ state[x][4] for x in range(5)]
        d = [c[(x - 1) % 5] ^ (((c[(x + 1) % 5] << 1) | (c[(x + 1) % 5] >> 63)) & _MASK)
             for x in range(5)]
        for x in range(5):
            for y in range(5):
                state[x][y] ^= d[x]
        b = [[0] * 5 for _ in range(5)]
        for x in range(5):
            for y in range(5):
                r = _ROTATIONS[x][y]
                b[y][(2 * x + 3 * y) % 5] = ((state[x][y] << r) | (state[x][y] >> (64 - r))) & _MASK
        for x in range(5):
            for y in range(5):
                state[x][y] = b[x][y] ^ ((~b[(x + 1) % 5][y]) & b[(x + 2) % 5][y])
        state[0][0] ^= constant


@lru_cache(maxsize=4096)  # contracts share code, and every plain account hashes empty code
def keccak256(data: bytes) -> bytes:
    """Ethereum's Keccak-256 (padding 0x01, not SHA3's 0x06)."""
    rate = 136
    padded = bytearray(data) + b"\x01" + bytes((-len(data) - 1) % rate)
    padded[-1] |= 0x80
    state = [[0] * 5 for _ in range(5)]
    for start in range(0, len(padded), rate):
        block = padded[start:start + rate]
        for i in range(rate // 8):
            state[i % 5][i // 5] ^= int.from_bytes(block[8 * i:8 * i + 8], "little")
        _keccak_f(state)
    return b"".join(state[i % 5][i // 5].to_bytes(8, "little") for i in range(4))


EMPTY_CODE_HASH = keccak256(b"")


@dataclass(frozen=True)
class Account:
    balance: int
    nonce: int
    code_hash: bytes = EMPTY_CODE_HASH
    code_size: int = 0

    def encode(self) -> bytes:
        """balance u256 BE || nonce u64 BE || code hash || code size u32 BE: 76 bytes."""
        return (self.balance.to_bytes(32, "big") + struct.pack(">Q", self.nonce)
                + self.code_hash + struct.pack(">I", self.code_size))

    @classmethod
    def decode(cls, value: bytes) -> "Account":
        if len(value) != ACCOUNT_VALUE_BYTES:
            raise ValueError(f"an account value is {ACCOUNT_VALUE_BYTES} bytes, got {len(value)}")
        return cls(int.from_bytes(value[:32], "big"), struct.unpack(">Q", value[32:40])[0],
                   bytes(value[40:72]), struct.unpack(">I", value[72:76])[0])


def storage_key(address: bytes, slot: bytes) -> bytes:
    """The storage table's key: the 20-byte address, then the 32-byte slot."""
    if len(address) != ADDRESS_BYTES or len(slot) != WORD_BYTES:
        raise ValueError("storage_key takes a 20-byte address and a 32-byte slot")
    return bytes(address) + bytes(slot)


def code_key(code_hash: bytes, chunk: int) -> bytes:
    """The code table's key: the code hash, then the chunk's index as u32 BE."""
    return bytes(code_hash) + struct.pack(">I", chunk)


def code_chunks(code: bytes) -> list:
    """The code's chunks of CODE_CHUNK_BYTES, the last zero-padded; the code size cuts them."""
    return [bytes(code[i:i + CODE_CHUNK_BYTES]).ljust(CODE_CHUNK_BYTES, b"\0")
            for i in range(0, len(code), CODE_CHUNK_BYTES)]


def state_key(kind: int, key: bytes) -> bytes:
    """The state table's key of a `kind` record (ACCOUNT_TYPE, STORAGE_TYPE, CODE_TYPE)."""
    if kind not in (ACCOUNT_TYPE, STORAGE_TYPE, CODE_TYPE) or len(key) > STORAGE_KEY_BYTES:
        raise ValueError(f"state_key takes a record type 1..3 and at most {STORAGE_KEY_BYTES} "
                         f"bytes of key, got type {kind} and {len(key)} bytes")
    return bytes([kind]) + bytes(key).ljust(STORAGE_KEY_BYTES, b"\0")


def state_value(value: bytes) -> bytes:
    """A record's value zero-padded to the state table's STATE_VALUE_BYTES."""
    return bytes(value).ljust(STATE_VALUE_BYTES, b"\0")

"""DPF keys of docs/PROTOCOL.md section 3: byte format, generation, point and full-domain eval."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from gpu_engine.prg import expand

SEED_BYTES = 16
MAX_DOMAIN_BITS = 32  # keys address at most 2**32 pages; the u8 field could say more
_HEADER = 19  # root_seed 16 + root_t + party + domain_bits
_LEVEL = 18  # seed_cw 16 + t_cw_left + t_cw_right
_ALL_ONES = b"\xff" * SEED_BYTES


class KeyFormatError(ValueError):
    """A key's bytes do not follow docs/PROTOCOL.md section 3; the message says what is wrong."""


def key_length(domain_bits: int) -> int:
    """Serialized length in bytes of a key of depth `domain_bits`."""
    return _HEADER + _LEVEL * domain_bits + SEED_BYTES


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


def _words(seed: bytes) -> np.ndarray:
    return np.frombuffer(seed, dtype="<u4").astype(np.uint32)


def _seed_bytes(words: np.ndarray) -> bytes:
    return np.asarray(words, dtype="<u4").tobytes()


@dataclass(frozen=True)
class DpfKey:
    """One party's DPF key."""

    root_seed: bytes
    root_t: int
    party: int
    domain_bits: int
    cw_seed: Tuple[bytes, ...]
    cw_t_left: Tuple[int, ...]
    cw_t_right: Tuple[int, ...]
    final_cw: bytes

    @classmethod
    def from_bytes(cls, data: bytes, expected_domain_bits: Optional[int] = None) -> "DpfKey":
        """Parse and validate; raises KeyFormatError saying what was expected and what came."""
        d = cls.check(data, expected_domain_bits)
        final = _HEADER + _LEVEL * d
        return cls(
            root_seed=bytes(data[:16]),
            root_t=data[16],
            party=data[17],
            domain_bits=d,
            cw_seed=tuple(bytes(data[off : off + 16]) for off in range(_HEADER, final, _LEVEL)),
            cw_t_left=tuple(data[_HEADER + 16 : final : _LEVEL]),
            cw_t_right=tuple(data[_HEADER + 17 : final : _LEVEL]),
            final_cw=bytes(data[final : final + 16]),
        )

    @staticmethod
    def check(data: bytes, expected_domain_bits: Optional[int] = None) -> int:
        """Validate a key's bytes without building it (the web tier checks every key of every
        request and forwards the bytes); its domain_bits, or KeyFormatError as from_bytes."""
        if len(data) < _HEADER:
            raise KeyFormatError(
                f"key is {len(data)} bytes, shorter than the {_HEADER}-byte header"
            )
        d = data[18]
        if not 1 <= d <= MAX_DOMAIN_BITS:
            raise KeyFormatError(f"domain_bits byte is {d}, expected 1..{MAX_DOMAIN_BITS}")
        if len(data) != key_length(d):
            raise KeyFormatError(
                f"key is {len(data)} bytes but its domain_bits byte says {d}, "
                f"which needs {key_length(d)} bytes"
            )
        if expected_domain_bits is not None and d != expected_domain_bits:
            raise KeyFormatError(
                f"key has domain_bits {d}, this server's epoch has domain_bits {expected_domain_bits}"
            )
        for name, offset in (("root_t", 16), ("party", 17)):
            if data[offset] not in (0, 1):
                raise KeyFormatError(f"{name} byte is {data[offset]}, expected 0 or 1")
        # The t bytes of every level at once (strided slices): the web tier parses every key of
        # every request, so this check runs per key; the loop below only words a failure.
        lefts = bytes(data[_HEADER + 16 : _HEADER + _LEVEL * d : _LEVEL])
        rights = bytes(data[_HEADER + 17 : _HEADER + _LEVEL * d : _LEVEL])
        if max(lefts) > 1 or max(rights) > 1:
            for level in range(d):
                for side, value in (("t_cw_left", lefts[level]), ("t_cw_right", rights[level])):
                    if value not in (0, 1):
                        raise KeyFormatError(f"level {level} {side} byte is {value}, expected 0 or 1")
        return d

    def to_bytes(self) -> bytes:
        out = bytearray(self.root_seed)
        out += bytes((self.root_t, self.party, self.domain_bits))
        for seed, tl, tr in zip(self.cw_seed, self.cw_t_left, self.cw_t_right):
            out += seed
            out += bytes((tl, tr))
        out += self.final_cw
        return bytes(out)


def _expand_one(seed: bytes):
    left, right, tl, tr = expand(_words(seed)[None, :])
    return _seed_bytes(left[0]), _seed_bytes(right[0]), int(tl[0]), int(tr[0])


def gen_keys(
    target: int,
    domain_bits: int,
    rng: Optional[np.random.Generator] = None,
    root_seeds: Optional[Tuple[bytes, bytes]] = None,
) -> Tuple[DpfKey, DpfKey]:
    """Client-side key generation for a point function at `target` (docs/PROTOCOL.md section 3)."""
    if not 1 <= domain_bits <= MAX_DOMAIN_BITS:
        raise ValueError(f"domain_bits must be in 1..{MAX_DOMAIN_BITS}, got {domain_bits}")
    if not 0 <= target < (1 << domain_bits):
        raise ValueError(f"target {target} is outside [0, 2**{domain_bits})")
    if root_seeds is None:
        draw = (lambda: rng.bytes(SEED_BYTES)) if rng is not None else (lambda: os.urandom(SEED_BYTES))
        root_seeds = (draw(), draw())
    s0, s1 = root_seeds
    t0, t1 = 0, 1
    cw_seed, cw_tl, cw_tr = [], [], []
    for level in range(domain_bits):
        l0, r0, tl0, tr0 = _expand_one(s0)
        l1, r1, tl1, tr1 = _expand_one(s1)
        bit = (target >> (domain_bits - 1 - level)) & 1
        if bit:
            keep0, keep1, lose0, lose1 = r0, r1, l0, l1
            keep_t0, keep_t1, lose_t0, lose_t1 = tr0, tr1, tl0, tl1
        else:
            keep0, keep1, lose0, lose1 = l0, l1, r0, r1
            keep_t0, keep_t1, lose_t0, lose_t1 = tl0, tl1, tr0, tr1
        scw = _xor(lose0, lose1)
        t_lose = lose_t0 ^ lose_t1 ^ t0 ^ t1 ^ 1
        t_keep = keep_t0 ^ keep_t1 ^ t0 ^ t1
        left_t, right_t = (t_lose, t_keep) if bit else (t_keep, t_lose)
        cw_seed.append(scw)
        cw_tl.append(left_t)
        cw_tr.append(right_t)
        s0 = _xor(keep0, scw) if t0 else keep0
        s1 = _xor(keep1, scw) if t1 else keep1
        t0, t1 = keep_t0 ^ (t_keep if t0 else 0), keep_t1 ^ (t_keep if t1 else 0)
    final_cw = _xor(_xor(s0, s1), _ALL_ONES)
    common = dict(
        domain_bits=domain_bits,
        cw_seed=tuple(cw_seed),
        cw_t_left=tuple(cw_tl),
        cw_t_right=tuple(cw_tr),
        final_cw=final_cw,
    )
    return (
        DpfKey(root_seed=root_seeds[0], root_t=0, party=0, **common),
        DpfKey(root_seed=root_seeds[1], root_t=1, party=1, **common),
    )


def eval_point(key: DpfKey, x: int) -> bytes:
    """The 16-byte mask of leaf x, walking one path from the root."""
    d = key.domain_bits
    if not 0 <= x < (1 << d):
        raise ValueError(f"x {x} is outside [0, 2**{d})")
    seed, t = key.root_seed, key.root_t
    for level in range(d):
        left, right, tl, tr = _expand_one(seed)
        if (x >> (d - 1 - level)) & 1:
            child, child_t, t_cw = right, tr, key.cw_t_right[level]
        else:
            child, child_t, t_cw = left, tl, key.cw_t_left[level]
        if t == 1:  # the parent's control bit decides the correction
            child, child_t = _xor(child, key.cw_seed[level]), child_t ^ t_cw
        seed, t = child, child_t
    return _xor(seed, key.final_cw) if t == 1 else seed


@dataclass(frozen=True)
class KeyBatch:
    """K keys of one depth packed as arrays, the form every backend consumes."""

    domain_bits: int
    root_seed: np.ndarray  # (K, 4) u32
    root_t: np.ndarray  # (K,) u8
    cw_seed: np.ndarray  # (K, d, 4) u32
    cw_t: np.ndarray  # (K, d, 2) u8: [left, right]
    final_cw: np.ndarray  # (K, 4) u32
    # The byte form these keys were parsed from, kept so that sending them on (to the engine
    # server) costs no re-encoding; None for batches built otherwise.
    raw: Optional[bytes] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_keys(cls, keys: Sequence[DpfKey]) -> "KeyBatch":
        if not keys:
            raise ValueError("a key batch needs at least one key")
        d = keys[0].domain_bits
        for i, key in enumerate(keys):
            if key.domain_bits != d:
                raise ValueError(f"key {i} has domain_bits {key.domain_bits}, key 0 has {d}")

        def words(chunks: Sequence[bytes]) -> np.ndarray:
            return np.frombuffer(b"".join(chunks), dtype="<u4").astype(np.uint32)

        k = len(keys)
        return cls(
            domain_bits=d,
            root_seed=words([key.root_seed for key in keys]).reshape(k, 4),
            root_t=np.array([key.root_t for key in keys], dtype=np.uint8),
            cw_seed=words([s for key in keys for s in key.cw_seed]).reshape(k, d, 4),
            cw_t=np.array(
                [list(zip(key.cw_t_left, key.cw_t_right)) for key in keys], dtype=np.uint8
            ).reshape(k, d, 2),
            final_cw=words([key.final_cw for key in keys]).reshape(k, 4),
        )

    @classmethod
    def from_bytes(cls, data, domain_bits: int) -> "KeyBatch":
        """Keys of depth `domain_bits` concatenated in the byte format, parsed in one pass.

        Checks what DpfKey.from_bytes checks; KeyFormatError names the first bad key."""
        size = key_length(domain_bits)
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size == 0 or raw.size % size:
            raise KeyFormatError(f"{raw.size} key bytes are not a whole number of "
                                 f"{size}-byte keys (domain_bits {domain_bits})")
        k = raw.size // size
        rows = raw.reshape(k, size)
        levels = rows[:, _HEADER:_HEADER + _LEVEL * domain_bits].reshape(k, domain_bits, _LEVEL)
        if (rows[:, 18] != domain_bits).any():
            bad = int(np.argmax(rows[:, 18] != domain_bits))
            raise KeyFormatError(f"key {bad} has domain_bits {rows[bad, 18]}, expected {domain_bits}")
        bits = np.concatenate([rows[:, 16:18], levels[:, :, 16:18].reshape(k, -1)], axis=1)
        if (bits > 1).any():
            bad = int(np.argmax((bits > 1).any(axis=1)))
            raise KeyFormatError(f"key {bad} has a root_t, party or t_cw byte other than 0 or 1")

        def words(block: np.ndarray, shape) -> np.ndarray:
            return np.ascontiguousarray(block).view("<u4").astype(np.uint32).reshape(shape)

        final = _HEADER + _LEVEL * domain_bits
        return cls(
            domain_bits=domain_bits,
            root_seed=words(rows[:, :16], (k, 4)),
            root_t=rows[:, 16].copy(),
            cw_seed=words(levels[:, :, :16], (k, domain_bits, 4)),
            cw_t=np.ascontiguousarray(levels[:, :, 16:18]),
            final_cw=words(rows[:, final:final + 16], (k, 4)),
            raw=bytes(data),
        )

    def keys(self, start: int, stop: int) -> "KeyBatch":
        """Keys start..stop-1 of this batch, as a batch of their own."""
        if not 0 <= start < stop <= len(self):
            raise IndexError(f"keys {start}..{stop - 1} of a batch of {len(self)}")
        size = key_length(self.domain_bits)
        return replace(
            self,
            root_seed=self.root_seed[start:stop], root_t=self.root_t[start:stop],
            cw_seed=self.cw_seed[start:stop], cw_t=self.cw_t[start:stop],
            final_cw=self.final_cw[start:stop],
            raw=None if self.raw is None else self.raw[start * size:stop * size],
        )

    def to_bytes(self) -> bytes:
        """The keys in the byte format, concatenated (party bytes from root_t: party b has t b)."""
        if self.raw is not None:
            return self.raw
        k, d = len(self), self.domain_bits
        rows = np.empty((k, key_length(d)), dtype=np.uint8)
        rows[:, :16] = self.root_seed.astype("<u4").view(np.uint8).reshape(k, 16)
        rows[:, 16] = self.root_t
        rows[:, 17] = self.root_t
        rows[:, 18] = d
        levels = rows[:, _HEADER:_HEADER + _LEVEL * d].reshape(k, d, _LEVEL)
        levels[:, :, :16] = self.cw_seed.astype("<u4").view(np.uint8).reshape(k, d, 16)
        levels[:, :, 16:18] = self.cw_t
        rows[:, _HEADER + _LEVEL * d:] = self.final_cw.astype("<u4").view(np.uint8).reshape(k, 16)
        return rows.tobytes()

    def __len__(self) -> int:
        return int(self.root_seed.shape[0])


def random_keys(count: int, domain_bits: int, rng: np.random.Generator) -> KeyBatch:
    """`count` well-formed keys of random content (warm-up launches and benchmarks)."""
    return KeyBatch(
        domain_bits=domain_bits,
        root_seed=rng.integers(0, 1 << 32, size=(count, 4), dtype=np.uint32),
        root_t=rng.integers(0, 2, size=count, dtype=np.uint8),
        cw_seed=rng.integers(0, 1 << 32, size=(count, domain_bits, 4), dtype=np.uint32),
        cw_t=rng.integers(0, 2, size=(count, domain_bits, 2), dtype=np.uint8),
        final_cw=rng.integers(0, 1 << 32, size=(count, 4), dtype=np.uint32),
    )


def _expand_level(batch: KeyBatch, level: int, seeds: np.ndarray, t: np.ndarray):
    """Children of nodes at `level`: (K, n, 4), (K, n) -> (K, 2n, 4), (K, 2n), corrected."""
    k, n = t.shape
    left, right, tl, tr = expand(seeds.reshape(k * n, 4))
    children = np.empty((k, n, 2, 4), dtype=np.uint32)
    children[:, :, 0] = left.reshape(k, n, 4)
    children[:, :, 1] = right.reshape(k, n, 4)
    child_t = np.empty((k, n, 2), dtype=np.uint8)
    child_t[:, :, 0] = tl.reshape(k, n)
    child_t[:, :, 1] = tr.reshape(k, n)
    # where a parent's t is 1, its children take the level's correction words
    on = np.uint32(0) - t.astype(np.uint32)  # 0 or 0xffffffff per parent
    children ^= batch.cw_seed[:, level][:, None, None, :] & on[:, :, None, None]
    child_t ^= batch.cw_t[:, level][:, None, :] & t[:, :, None]
    return children.reshape(k, 2 * n, 4), child_t.reshape(k, 2 * n)


def _leaves(batch: KeyBatch, seeds: np.ndarray, t: np.ndarray) -> np.ndarray:
    on = np.uint32(0) - t.astype(np.uint32)
    return seeds ^ (batch.final_cw[:, None, :] & on[:, :, None])


def _descend(batch: KeyBatch, level: int, first: int, seeds, t, num_leaves: int, to_level: int):
    """Expand nodes [first, first+n) of `level` down to `to_level`, dropping nodes past num_leaves."""
    d = batch.domain_bits
    while level < to_level:
        seeds, t = _expand_level(batch, level, seeds, t)
        level += 1
        first *= 2
        needed = -(-num_leaves // (1 << (d - level)))  # nodes of this level that hold a leaf
        keep = max(0, min(seeds.shape[1], needed - first))
        seeds, t = seeds[:, :keep], t[:, :keep]
    return seeds, t


def iter_mask_chunks(
    batch: KeyBatch, num_leaves: int, chunk_bits: int, part: int = 0, parts: int = 1
) -> Iterator[Tuple[int, np.ndarray]]:
    """Yield (first_leaf, masks (K, n, 4) u32) over [0, num_leaves), each tree node expanded once.

    Memory stays at K * 2**chunk_bits masks whatever the domain size. With parts > 1 only
    every parts-th chunk (from `part`) is yielded, so workers can share one domain.
    """
    d = batch.domain_bits
    if not 1 <= num_leaves <= (1 << d):
        raise ValueError(f"num_leaves {num_leaves} is outside [1, 2**{d}]")
    top = max(0, d - chunk_bits)
    seeds, t = _descend(
        batch, 0, 0, batch.root_seed[:, None, :].copy(), batch.root_t[:, None].copy(), num_leaves, top
    )
    span = 1 << (d - top)
    for node in range(part, seeds.shape[1], parts):
        leaf_seeds, leaf_t = _descend(
            batch, top, node, seeds[:, node : node + 1], t[:, node : node + 1], num_leaves, d
        )
        yield node * span, _leaves(batch, leaf_seeds, leaf_t)


def eval_full(batch: KeyBatch, num_leaves: int) -> np.ndarray:
    """Masks of leaves [0, num_leaves) for every key: (K, num_leaves, 4) u32."""
    chunks = [m for _, m in iter_mask_chunks(batch, num_leaves, batch.domain_bits)]
    return np.concatenate(chunks, axis=1)

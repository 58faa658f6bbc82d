"""DPF keys of docs/PROTOCOL.md section 3: byte format, generation, point and full-domain eval.

Two key formats (section 3 and 3.1), told apart by byte 18: v1 (its domain_bits byte, 1..32)
gives every page a 16-byte mask; v2 (V2_MARKER) stops the tree LEAF_PAGE_BITS levels early and
its leaf selects among LEAF_PAGES pages by one bit each. `domain_bits` is the pages' domain in
both; `tree_depth` the levels a key holds correction words for."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from morpho_pir.prg import expand
from morpho_pir.protocol import KEY_FORMAT_NAMES, LEAF_PAGE_BITS, LEAF_PAGES

SEED_BYTES = 16
MAX_DOMAIN_BITS = 32  # keys address at most 2**32 pages; the u8 field could say more
_HEADER = 19  # root_seed 16 + root_t + party + domain_bits
_LEVEL = 18  # seed_cw 16 + t_cw_left + t_cw_right
_ALL_ONES = b"\xff" * SEED_BYTES
KEY_FORMAT_V1 = 1  # section 3: byte 18 is domain_bits, a leaf is one page's 16-byte mask
KEY_FORMAT_V2 = 2  # section 3.1: byte 18 is V2_MARKER, a leaf is 128 pages' selection bits
V2_MARKER = 0x82  # byte 18 of a v2 key: bit 7 (never a v1 domain_bits, 1..32) | format 2
_V2_HEADER = 20  # root_seed 16 + root_t + party + marker + domain_bits


class KeyFormatError(ValueError):
    """A key's bytes do not follow docs/PROTOCOL.md section 3; the message says what is wrong."""


def format_name(key_format: int) -> str:
    """A key format's name as /epoch advertises it: "v1" or "v2"."""
    return KEY_FORMAT_NAMES[key_format - 1]


def format_by_name(name: str) -> int:
    """KEY_FORMAT_V1 or KEY_FORMAT_V2 from "v1" or "v2"; ValueError otherwise."""
    if name not in KEY_FORMAT_NAMES:
        raise ValueError(f"unknown key format {name!r}, expected one of {', '.join(KEY_FORMAT_NAMES)}")
    return KEY_FORMAT_NAMES.index(name) + 1


def tree_depth(domain_bits: int, key_format: int = KEY_FORMAT_V1) -> int:
    """Levels of a key's tree: d for v1, max(d - 7, 0) for v2 (its leaves cover 128 pages)."""
    return domain_bits if key_format == KEY_FORMAT_V1 else max(domain_bits - LEAF_PAGE_BITS, 0)


def _v2_prefix(key_format: int) -> str:
    """"v2 " in the messages about v2 keys; v1 keys keep the messages they always had."""
    return "" if key_format == KEY_FORMAT_V1 else "v2 "


def _header(key_format: int) -> int:
    return _HEADER if key_format == KEY_FORMAT_V1 else _V2_HEADER


def key_length(domain_bits: int, key_format: int = KEY_FORMAT_V1) -> int:
    """Serialized length in bytes of a key for a domain of 2**domain_bits pages:
    35 + 18 d (v1), 36 + 18 max(d - 7, 0) (v2)."""
    return _header(key_format) + _LEVEL * tree_depth(domain_bits, key_format) + SEED_BYTES


def key_format_of(data) -> int:
    """The format a key's bytes name in byte 18 (V2_MARKER: v2; anything else is read as v1, whose
    check then says what is wrong). For a body of keys of one format, its first key's."""
    return KEY_FORMAT_V2 if len(data) > 18 and data[18] == V2_MARKER else KEY_FORMAT_V1


FORMAT_BYTE = 18  # the byte that names a key's format (docs/PROTOCOL.md section 3.1)


def format_byte_problem(data) -> Optional[str]:
    """Why byte 18 of a key names no key format, or None: 0x80 up name formats and 0x82 (v2) is
    the only one known; below 0x80 it is a v1 key's domain_bits byte, which the v1 rules check.
    None too for a key too short to hold byte 18 (its length is what is wrong)."""
    if len(data) <= FORMAT_BYTE or data[FORMAT_BYTE] < 0x80 or data[FORMAT_BYTE] == V2_MARKER:
        return None
    return (f"format byte (byte 18) is {data[FORMAT_BYTE]:#04x}: expected 1..{MAX_DOMAIN_BITS} "
            f"(a v1 key's domain_bits) or {V2_MARKER:#x} (a v2 key)")


def key_length_from_bytes(data, domain_bits: int) -> int:
    """Length of each key of `data` (one key, or keys of one format concatenated) for a domain of
    2**domain_bits pages, in the format the first key's byte 18 names: what a receiver of raw key
    bytes divides by (key_length(domain_bits) is the v1 length alone)."""
    return key_length(domain_bits, key_format_of(data))


def key_domain_bits(data) -> int:
    """The domain_bits a key's bytes carry (byte 18 in v1, byte 19 in v2), unchecked."""
    return data[19] if key_format_of(data) == KEY_FORMAT_V2 else data[18]


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
    key_format: int = KEY_FORMAT_V1  # v2: cw_* cover tree_depth levels, final_cw ends the tree early

    @property
    def tree_depth(self) -> int:
        return tree_depth(self.domain_bits, self.key_format)

    @classmethod
    def from_bytes(cls, data: bytes, expected_domain_bits: Optional[int] = None) -> "DpfKey":
        """Parse and validate; raises KeyFormatError saying what was expected and what came."""
        d = cls.check(data, expected_domain_bits)
        fmt = key_format_of(data)
        head = _header(fmt)
        final = head + _LEVEL * tree_depth(d, fmt)
        return cls(
            root_seed=bytes(data[:16]),
            root_t=data[16],
            party=data[17],
            domain_bits=d,
            cw_seed=tuple(bytes(data[off : off + 16]) for off in range(head, final, _LEVEL)),
            cw_t_left=tuple(data[head + 16 : final : _LEVEL]),
            cw_t_right=tuple(data[head + 17 : final : _LEVEL]),
            final_cw=bytes(data[final : final + 16]),
            key_format=fmt,
        )

    @staticmethod
    def check(data: bytes, expected_domain_bits: Optional[int] = None) -> int:
        """Validate a key's bytes without building it (the web tier checks every key of every
        request and forwards the bytes); its domain_bits, or KeyFormatError as from_bytes.
        Either format: byte 18 says which (key_format_of)."""
        if len(data) < _HEADER:
            raise KeyFormatError(
                f"key is {len(data)} bytes, shorter than the {_HEADER}-byte header"
            )
        fmt = key_format_of(data)
        if fmt == KEY_FORMAT_V2:
            if len(data) < _V2_HEADER:
                raise KeyFormatError(f"v2 key is {len(data)} bytes, shorter than the "
                                     f"{_V2_HEADER}-byte header")
            d = data[19]
            if not 1 <= d <= MAX_DOMAIN_BITS:
                raise KeyFormatError(f"v2 key's domain_bits byte (byte 19) is {d}, "
                                     f"expected 1..{MAX_DOMAIN_BITS}")
        else:
            d = data[18]
            if not 1 <= d <= MAX_DOMAIN_BITS:
                raise KeyFormatError(f"domain_bits byte is {d}, expected 1..{MAX_DOMAIN_BITS} "
                                     f"(or {V2_MARKER:#x}, the marker of a v2 key)")
        if len(data) != key_length(d, fmt):
            raise KeyFormatError(
                f"{_v2_prefix(fmt)}key is {len(data)} bytes but its domain_bits byte says {d}, "
                f"which needs {key_length(d, fmt)} bytes"
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
        head, n = _header(fmt), tree_depth(d, fmt)
        lefts = bytes(data[head + 16 : head + _LEVEL * n : _LEVEL])
        rights = bytes(data[head + 17 : head + _LEVEL * n : _LEVEL])
        if max(lefts, default=0) > 1 or max(rights, default=0) > 1:
            for level in range(n):
                for side, value in (("t_cw_left", lefts[level]), ("t_cw_right", rights[level])):
                    if value not in (0, 1):
                        raise KeyFormatError(f"level {level} {side} byte is {value}, expected 0 or 1")
        return d

    def to_bytes(self) -> bytes:
        out = bytearray(self.root_seed)
        out += bytes((self.root_t, self.party))
        if self.key_format == KEY_FORMAT_V2:
            out.append(V2_MARKER)
        out.append(self.domain_bits)
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
    key_format: int = KEY_FORMAT_V1,
) -> Tuple[DpfKey, DpfKey]:
    """Client-side key generation for a point function at page `target` (docs/PROTOCOL.md
    section 3; with KEY_FORMAT_V2, section 3.1: the tree leads to leaf target >> 7, and final_cw
    makes the two leaves there differ in bit target & 127 alone)."""
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
    depth = tree_depth(domain_bits, key_format)
    leaf = target >> (domain_bits - depth)  # v1: the page itself; v2: target >> 7
    for level in range(depth):
        l0, r0, tl0, tr0 = _expand_one(s0)
        l1, r1, tl1, tr1 = _expand_one(s1)
        bit = (leaf >> (depth - 1 - level)) & 1
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
    final_cw = _xor(_xor(s0, s1), leaf_difference(target, key_format))
    common = dict(
        domain_bits=domain_bits,
        cw_seed=tuple(cw_seed),
        cw_t_left=tuple(cw_tl),
        cw_t_right=tuple(cw_tr),
        final_cw=final_cw,
        key_format=key_format,
    )
    return (
        DpfKey(root_seed=root_seeds[0], root_t=0, party=0, **common),
        DpfKey(root_seed=root_seeds[1], root_t=1, party=1, **common),
    )


def leaf_difference(target: int, key_format: int = KEY_FORMAT_V1) -> bytes:
    """What the two parties' leaves on the target's path XOR to: 16 bytes of 0xff (v1), or the
    one-hot 128-bit vector of bit target & 127 (v2: bit j is bit j % 8 of byte j // 8)."""
    if key_format == KEY_FORMAT_V1:
        return _ALL_ONES
    return (1 << (target & (LEAF_PAGES - 1))).to_bytes(SEED_BYTES, "little")


def page_mask(key: DpfKey, page: int) -> bytes:
    """The 16 bytes section 4 ANDs page `page` with: its leaf (v1), or in v2 16 bytes of 0xff
    where the page's selection bit (bit page & 127 of leaf page >> 7) is 1, zeros where 0."""
    if not 0 <= page < (1 << key.domain_bits):
        raise ValueError(f"page {page} is outside [0, 2**{key.domain_bits})")
    if key.key_format == KEY_FORMAT_V1:
        return eval_point(key, page)
    leaf = int.from_bytes(eval_point(key, page >> LEAF_PAGE_BITS), "little")
    return _ALL_ONES if (leaf >> (page & (LEAF_PAGES - 1))) & 1 else bytes(SEED_BYTES)


def eval_point(key: DpfKey, x: int) -> bytes:
    """The 16 bytes of leaf x, walking one path from the root (v1: the mask of page x; v2: the
    selection bits of pages 128 x .. 128 x + 127)."""
    d = key.tree_depth
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
    """K keys of one format and domain packed as arrays, the form every backend consumes."""

    domain_bits: int  # the pages' domain, as the epoch's; the tree has tree_depth levels
    root_seed: np.ndarray  # (K, 4) u32
    root_t: np.ndarray  # (K,) u8
    cw_seed: np.ndarray  # (K, n, 4) u32, n = tree_depth
    cw_t: np.ndarray  # (K, n, 2) u8: [left, right]
    final_cw: np.ndarray  # (K, 4) u32
    # The byte form these keys were parsed from, kept so that sending them on (to the engine
    # server) costs no re-encoding; None for batches built otherwise.
    raw: Optional[bytes] = field(default=None, compare=False, repr=False)
    key_format: int = KEY_FORMAT_V1

    @property
    def tree_depth(self) -> int:
        return tree_depth(self.domain_bits, self.key_format)

    @classmethod
    def from_keys(cls, keys: Sequence[DpfKey]) -> "KeyBatch":
        if not keys:
            raise ValueError("a key batch needs at least one key")
        d, fmt = keys[0].domain_bits, keys[0].key_format
        for i, key in enumerate(keys):
            if key.domain_bits != d:
                raise ValueError(f"key {i} has domain_bits {key.domain_bits}, key 0 has {d}")
            if key.key_format != fmt:
                raise ValueError(f"key {i} is a {format_name(key.key_format)} key, key 0 a "
                                 f"{format_name(fmt)} key: one format per batch")

        def words(chunks: Sequence[bytes]) -> np.ndarray:
            return np.frombuffer(b"".join(chunks), dtype="<u4").astype(np.uint32)

        k, n = len(keys), keys[0].tree_depth
        return cls(
            domain_bits=d,
            root_seed=words([key.root_seed for key in keys]).reshape(k, 4),
            root_t=np.array([key.root_t for key in keys], dtype=np.uint8),
            cw_seed=words([s for key in keys for s in key.cw_seed]).reshape(k, n, 4),
            cw_t=np.array(
                [list(zip(key.cw_t_left, key.cw_t_right)) for key in keys], dtype=np.uint8
            ).reshape(k, n, 2),
            final_cw=words([key.final_cw for key in keys]).reshape(k, 4),
            key_format=fmt,
        )

    @classmethod
    def from_bytes(cls, data, domain_bits: int, trusted: bool = False) -> "KeyBatch":
        """Keys for a domain of 2**domain_bits pages concatenated in the byte format, parsed in
        one pass; the first key's byte 18 says the format, which every key must share.

        Checks what DpfKey.from_bytes checks; KeyFormatError names the first bad key. trusted:
        keys a boundary checked one by one already (DpfKey.check, of one format and domain),
        parsed without those checks."""
        fmt = key_format_of(data)
        head, n = _header(fmt), tree_depth(domain_bits, fmt)
        size = key_length(domain_bits, fmt)
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size == 0 or raw.size % size:
            raise KeyFormatError(f"{raw.size} key bytes are not a whole number of "
                                 f"{size}-byte {_v2_prefix(fmt)}keys (domain_bits {domain_bits})")
        k = raw.size // size
        rows = raw.reshape(k, size)
        levels = rows[:, head:head + _LEVEL * n].reshape(k, n, _LEVEL)
        if not trusted:
            cls._check_rows(rows, levels, fmt, head, domain_bits)

        def words(block: np.ndarray, shape) -> np.ndarray:
            return np.ascontiguousarray(block).view("<u4").astype(np.uint32).reshape(shape)

        final = head + _LEVEL * n
        return cls(
            domain_bits=domain_bits,
            root_seed=words(rows[:, :16], (k, 4)),
            root_t=rows[:, 16].copy(),
            cw_seed=words(levels[:, :, :16], (k, n, 4)),
            cw_t=np.ascontiguousarray(levels[:, :, 16:18]),
            final_cw=words(rows[:, final:final + 16], (k, 4)),
            raw=bytes(data),
            key_format=fmt,
        )

    @staticmethod
    def _check_rows(rows: np.ndarray, levels: np.ndarray, fmt: int, head: int,
                    domain_bits: int) -> None:
        """from_bytes' checks of (K, key_length) key rows, all keys at once."""
        k = rows.shape[0]
        if fmt == KEY_FORMAT_V2 and (rows[:, 18] != V2_MARKER).any():
            bad = int(np.argmax(rows[:, 18] != V2_MARKER))
            raise KeyFormatError(f"key {bad} has byte 18 {rows[bad, 18]}, expected {V2_MARKER:#x} "
                                 f"as key 0 (a v2 key): one key format per request")
        if (rows[:, head - 1] != domain_bits).any():
            bad = int(np.argmax(rows[:, head - 1] != domain_bits))
            raise KeyFormatError(f"key {bad} has domain_bits {rows[bad, head - 1]}, "
                                 f"expected {domain_bits}")
        bits = np.concatenate([rows[:, 16:18], levels[:, :, 16:18].reshape(k, -1)], axis=1)
        if (bits > 1).any():
            bad = int(np.argmax((bits > 1).any(axis=1)))
            raise KeyFormatError(f"key {bad} has a root_t, party or t_cw byte other than 0 or 1")

    def keys(self, start: int, stop: int) -> "KeyBatch":
        """Keys start..stop-1 of this batch, as a batch of their own."""
        if not 0 <= start < stop <= len(self):
            raise IndexError(f"keys {start}..{stop - 1} of a batch of {len(self)}")
        size = key_length(self.domain_bits, self.key_format)
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
        return key_rows(self.domain_bits, self.key_format, self.root_seed, self.root_t,
                        self.root_t, self.cw_seed, self.cw_t, self.final_cw).tobytes()

    def __len__(self) -> int:
        return int(self.root_seed.shape[0])


def key_rows(domain_bits: int, key_format: int, root_seed, root_t, party, cw_seed, cw_t,
             final_cw) -> np.ndarray:
    """K keys in the byte format as one (K, key_length) u8 array, from the arrays of a batch:
    root_seed (K, 4) u32 or (K, 16) u8, root_t and party (K,) or scalars, cw_seed (K, n, 4) u32,
    cw_t (K, n, 2) u8, final_cw (K, 4) u32."""
    k, n = cw_seed.shape[0], tree_depth(domain_bits, key_format)
    head = _header(key_format)
    rows = np.empty((k, key_length(domain_bits, key_format)), dtype=np.uint8)
    root = np.asarray(root_seed)
    root = root if root.dtype == np.uint8 else root.astype("<u4")
    rows[:, :16] = np.ascontiguousarray(root).view(np.uint8).reshape(k, 16)
    rows[:, 16] = root_t
    rows[:, 17] = party
    if key_format == KEY_FORMAT_V2:
        rows[:, 18] = V2_MARKER
    rows[:, head - 1] = domain_bits
    levels = rows[:, head:head + _LEVEL * n].reshape(k, n, _LEVEL)
    levels[:, :, :16] = cw_seed.astype("<u4").view(np.uint8).reshape(k, n, 16)
    levels[:, :, 16:18] = cw_t
    rows[:, head + _LEVEL * n:] = final_cw.astype("<u4").view(np.uint8).reshape(k, 16)
    return rows


def random_keys(count: int, domain_bits: int, rng: np.random.Generator,
                key_format: int = KEY_FORMAT_V1) -> KeyBatch:
    """`count` well-formed keys of random content (warm-up launches and benchmarks)."""
    n = tree_depth(domain_bits, key_format)
    return KeyBatch(
        domain_bits=domain_bits,
        root_seed=rng.integers(0, 1 << 32, size=(count, 4), dtype=np.uint32),
        root_t=rng.integers(0, 2, size=count, dtype=np.uint8),
        cw_seed=rng.integers(0, 1 << 32, size=(count, n, 4), dtype=np.uint32),
        cw_t=rng.integers(0, 2, size=(count, n, 2), dtype=np.uint8),
        final_cw=rng.integers(0, 1 << 32, size=(count, 4), dtype=np.uint32),
        key_format=key_format,
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


def subtree_keys(batch: KeyBatch, level: int, index: int) -> KeyBatch:
    """Keys for the subtree under node `index` of `level`, as trees of their own: leaf j of each
    is leaf index * 2**(tree_depth - level) + j of the key it came from.

    A node's seed and control bit, with the correction words of the levels below it and the same
    final_cw, evaluate exactly as the whole key does under that node (docs/PROTOCOL.md sections
    3 and 3.1), so a device holding only the pages under one node answers for them with a key of
    domain_bits - level (gpu_engine.placement shards pages over devices so)."""
    return subtree_keys_many(batch, [(level, index)])[0]


def subtree_keys_many(batch: KeyBatch, nodes: Sequence[Tuple[int, int]]) -> List[KeyBatch]:
    """subtree_keys for each (level, index) of `nodes`, in order. The host expands each tree
    level once, for every node of that level on the way to one of them: one vectorised ChaCha
    call a level (0.7 ms for a 1-query batch on the lent H100 hosts; more for more keys), not one
    a node and level, so a shard's keys for all its devices cost as much as the deepest node's."""
    if not nodes:
        return []
    for level, index in nodes:
        if not 0 <= level <= batch.tree_depth or batch.domain_bits - level < 1:
            raise ValueError(f"level {level} is outside 0..{min(batch.tree_depth, batch.domain_bits - 1)} "
                             f"for {format_name(batch.key_format)} keys of domain_bits {batch.domain_bits}")
        if not 0 <= index < (1 << level):
            raise ValueError(f"node {index} is outside [0, 2**{level})")
    # the nodes of the current depth that some wanted node lies under: index -> (seed, t) per key
    frontier = {0: (batch.root_seed, batch.root_t)}
    found: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}
    for depth in range(max(level for level, _ in nodes) + 1):
        found.update({(depth, i): frontier[i] for level, i in nodes if level == depth})
        parents = sorted({i >> (level - depth) for level, i in nodes if level > depth})
        if not parents:
            break
        seeds = np.stack([frontier[i][0] for i in parents], axis=1)
        t = np.stack([frontier[i][1] for i in parents], axis=1)
        children, child_t = _expand_level(batch, depth, seeds, t)
        frontier = {2 * parent + side: (children[:, 2 * j + side], child_t[:, 2 * j + side])
                    for j, parent in enumerate(parents) for side in (0, 1)}
    return [batch if level == 0 else KeyBatch(
        domain_bits=batch.domain_bits - level,
        root_seed=np.ascontiguousarray(found[level, index][0]),
        root_t=np.ascontiguousarray(found[level, index][1]),
        cw_seed=np.ascontiguousarray(batch.cw_seed[:, level:]),
        cw_t=np.ascontiguousarray(batch.cw_t[:, level:]),
        final_cw=batch.final_cw,
        key_format=batch.key_format,
    ) for level, index in nodes]


def _leaves(batch: KeyBatch, seeds: np.ndarray, t: np.ndarray) -> np.ndarray:
    on = np.uint32(0) - t.astype(np.uint32)
    return seeds ^ (batch.final_cw[:, None, :] & on[:, :, None])


def _descend(batch: KeyBatch, level: int, first: int, seeds, t, num_leaves: int, to_level: int):
    """Expand nodes [first, first+n) of `level` down to `to_level`, dropping nodes past num_leaves."""
    d = batch.tree_depth
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
    every parts-th chunk (from `part`) is yielded, so workers can share one domain. Leaves are
    the tree's: pages in v1, groups of 128 pages in v2 (iter_page_masks gives pages in both).
    """
    d = batch.tree_depth
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


def selection_masks(leaves: np.ndarray) -> np.ndarray:
    """v2 leaves (K, n, 4) u32 -> the masks section 4 ANDs their pages with, (K, 128 n, 4) u32:
    0xffffffff words where the page's selection bit is 1, zeros where 0. Page 128 i + j of leaf
    i has bit j: bit j % 32 of word j // 32 (bit j % 8 of byte j // 8)."""
    k, n = leaves.shape[:2]
    bits = (leaves[:, :, :, None] >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    on = np.uint32(0) - bits.reshape(k, n * LEAF_PAGES)
    return np.repeat(on[:, :, None], 4, axis=2)


def iter_page_masks(
    batch: KeyBatch, num_pages: int, chunk_bits: int, part: int = 0, parts: int = 1
) -> Iterator[Tuple[int, np.ndarray]]:
    """Yield (first_page, masks (K, n, 4) u32) over pages [0, num_pages) in either key format:
    the 16 bytes section 4 ANDs each page with. Chunks hold 2**chunk_bits pages (at least one v2
    leaf, 128 pages); `part` and `parts` share the pages among workers as in iter_mask_chunks."""
    if batch.key_format == KEY_FORMAT_V1:
        yield from iter_mask_chunks(batch, num_pages, chunk_bits, part, parts)
        return
    if not 1 <= num_pages <= (1 << batch.domain_bits):
        raise ValueError(f"num_pages {num_pages} is outside [1, 2**{batch.domain_bits}]")
    num_leaves = -(-num_pages // LEAF_PAGES)
    for first, leaves in iter_mask_chunks(batch, num_leaves, max(0, chunk_bits - LEAF_PAGE_BITS),
                                          part, parts):
        first_page = first * LEAF_PAGES
        # bits past num_pages select nothing: their pages are not part of the answer
        yield first_page, selection_masks(leaves)[:, :num_pages - first_page]


def eval_full(batch: KeyBatch, num_leaves: int) -> np.ndarray:
    """The tree's leaves [0, num_leaves) for every key: (K, num_leaves, 4) u32 (v1: page masks;
    v2: selection bits, 128 pages a leaf)."""
    chunks = [m for _, m in iter_mask_chunks(batch, num_leaves, batch.tree_depth)]
    return np.concatenate(chunks, axis=1)


def eval_pages(batch: KeyBatch, num_pages: int) -> np.ndarray:
    """The mask section 4 ANDs each of pages [0, num_pages) with, for every key, in either
    format: (K, num_pages, 4) u32."""
    chunks = [m for _, m in iter_page_masks(batch, num_pages, batch.domain_bits)]
    return np.concatenate(chunks, axis=1)

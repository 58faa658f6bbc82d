"""DPF key generation for many targets at once: all key pairs of a batch level by level in NumPy."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

# The byte layout's offsets live in dpf.py, the one home of PROTOCOL.md section 3's format.
from morpho_pir.dpf import (
    KEY_FORMAT_V1,
    KEY_FORMAT_V2,
    MAX_DOMAIN_BITS,
    SEED_BYTES,
    DpfKey,
    KeyBatch,
    key_length,
    key_rows,
    tree_depth,
)
from morpho_pir.prg import expand_words
from morpho_pir.protocol import LEAF_PAGES


@dataclass(frozen=True)
class KeyPairs:
    """K DPF key pairs of one depth as arrays; key i of party b is `key_bytes(b)[i]`.

    Both parties' keys share the correction words and final_cw; they differ in root seed,
    root_t (= party) and party, exactly as `morpho_pir.dpf.gen_keys` makes them.
    """

    domain_bits: int
    root_seeds: np.ndarray  # (K, 2, 16) u8: party 0's root seed, then party 1's
    cw_seed: np.ndarray  # (K, n, 4) u32, n = tree_depth(d, key_format)
    cw_t: np.ndarray  # (K, n, 2) u8: [left, right]
    final_cw: np.ndarray  # (K, 4) u32
    key_format: int = KEY_FORMAT_V1

    def __len__(self) -> int:
        return int(self.root_seeds.shape[0])

    @property
    def key_size(self) -> int:
        """Bytes of one key: 35 + 18 d (v1), 36 + 18 max(d - 7, 0) (v2)."""
        return key_length(self.domain_bits, self.key_format)

    def key_array(self, party: int) -> np.ndarray:
        """Party `party`'s K serialized keys as one (K, key_size) u8 array."""
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1, got {party}")
        # root_t is the party's number
        return key_rows(self.domain_bits, self.key_format, self.root_seeds[:, party], party,
                        party, self.cw_seed, self.cw_t, self.final_cw)

    def key_bytes(self, party: int) -> list[bytes]:
        """Party `party`'s K keys in PROTOCOL.md section 3's byte format."""
        raw = self.key_array(party).tobytes()
        size = self.key_size
        return [raw[i:i + size] for i in range(0, len(raw), size)]

    def key_hex(self, party: int) -> list[str]:
        """The same keys as lower-case hex strings (no 0x), as the JSON API takes them."""
        text = self.key_array(party).tobytes().hex()
        size = 2 * self.key_size
        return [text[i:i + size] for i in range(0, len(text), size)]

    def pair(self, index: int) -> tuple[DpfKey, DpfKey]:
        """Key pair `index` as DpfKey objects (for tests and point evaluation)."""
        return tuple(DpfKey.from_bytes(self.key_array(party)[index].tobytes()) for party in (0, 1))

    def key_batch(self, party: int) -> KeyBatch:
        """Party `party`'s keys packed as the backends consume them."""
        k = len(self)
        return KeyBatch(
            domain_bits=self.domain_bits,
            root_seed=np.ascontiguousarray(self.root_seeds[:, party]).view("<u4")
            .astype(np.uint32).reshape(k, 4),
            root_t=np.full(k, party, dtype=np.uint8),
            cw_seed=self.cw_seed.copy(),
            cw_t=self.cw_t.copy(),
            final_cw=self.final_cw.copy(),
            key_format=self.key_format,
        )


def random_root_seeds(count: int, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """(count, 2, 16) u8 fresh root seeds: os.urandom, or `rng` for reproducible tests."""
    size = count * 2 * SEED_BYTES
    raw = rng.bytes(size) if rng is not None else os.urandom(size)
    return np.frombuffer(raw, dtype=np.uint8).reshape(count, 2, SEED_BYTES).copy()


def gen_key_pairs(
    targets: Sequence[int],
    domain_bits: int,
    root_seeds=None,
    rng: Optional[np.random.Generator] = None,
    key_format: int = KEY_FORMAT_V1,
) -> KeyPairs:
    """Key pairs for every target page at once (PROTOCOL.md section 3, or 3.1 with
    KEY_FORMAT_V2), vectorised over the targets.

    `root_seeds` is (K, 2, 16) bytes-like (party 0's root, party 1's root per target) or None for
    fresh random ones. Given the same roots, pair i is byte for byte `gen_keys(targets[i], ...)`.
    """
    if not 1 <= domain_bits <= MAX_DOMAIN_BITS:
        raise ValueError(f"domain_bits must be in 1..{MAX_DOMAIN_BITS}, got {domain_bits}")
    target = np.asarray(targets, dtype=np.int64).reshape(-1)
    k = target.shape[0]
    if k == 0:
        raise ValueError("expected at least one target")
    bad = (target < 0) | (target >= (1 << domain_bits))
    if bad.any():
        first = int(target[np.argmax(bad)])
        raise ValueError(f"target {first} is outside [0, 2**{domain_bits})")
    if root_seeds is None:
        roots = random_root_seeds(k, rng)
    else:
        roots = np.asarray(root_seeds, dtype=np.uint8)
        if roots.shape != (k, 2, SEED_BYTES):
            raise ValueError(
                f"root_seeds must have shape ({k}, 2, {SEED_BYTES}), got {roots.shape}"
            )
    d = tree_depth(domain_bits, key_format)
    leaf = target >> (domain_bits - d)  # v1: the page; v2: its leaf of 128 pages
    # Columns 0..k-1 are party 0's nodes, k..2k-1 party 1's, the four seed words as rows: one
    # expand call per level for both, each step on contiguous rows, nothing transposed.
    seeds = np.ascontiguousarray(roots.transpose(1, 0, 2)).view("<u4").astype(np.uint32)
    seeds = np.ascontiguousarray(seeds.reshape(2 * k, 4).T)
    t = np.concatenate([np.zeros(k, dtype=np.uint8), np.ones(k, dtype=np.uint8)])
    cw_seed = np.empty((k, d, 4), dtype=np.uint32)
    cw_t = np.empty((k, d, 2), dtype=np.uint8)
    for level in range(d):
        left, right, t_left, t_right = expand_words(seeds)
        bit = ((leaf >> (d - 1 - level)) & 1).astype(bool)
        bit2 = np.concatenate([bit, bit])  # the same path bit for both parties' columns
        keep = np.where(bit2, right, left)
        lose = np.where(bit2, left, right)
        keep_t = np.where(bit2, t_right, t_left)
        lose_t = np.where(bit2, t_left, t_right)
        scw = lose[:, :k] ^ lose[:, k:]
        t_both = t[:k] ^ t[k:]
        t_lose = lose_t[:k] ^ lose_t[k:] ^ t_both ^ 1
        t_keep = keep_t[:k] ^ keep_t[k:] ^ t_both
        cw_seed[:, level] = scw.T
        cw_t[:, level, 0] = np.where(bit, t_lose, t_keep)
        cw_t[:, level, 1] = np.where(bit, t_keep, t_lose)
        # Each party moves to its keep child, corrected where its own t is 1.
        on = np.uint32(0) - t.astype(np.uint32)  # 0 or 0xffffffff per column
        seeds = keep ^ (np.concatenate([scw, scw], axis=1) & on)
        t = keep_t ^ (np.concatenate([t_keep, t_keep]) & t)
    if key_format == KEY_FORMAT_V2:  # the one-hot vector of bit target & 127 (section 3.1)
        j = target & (LEAF_PAGES - 1)
        difference = np.where(np.arange(4)[None, :] == (j // 32)[:, None],
                              np.uint32(1) << (j % 32).astype(np.uint32)[:, None], np.uint32(0))
    else:
        difference = np.uint32(0xFFFFFFFF)
    final_cw = np.ascontiguousarray((seeds[:, :k] ^ seeds[:, k:]).T) ^ difference.astype(np.uint32)
    return KeyPairs(domain_bits=domain_bits, root_seeds=roots, cw_seed=cw_seed, cw_t=cw_t,
                    final_cw=final_cw, key_format=key_format)

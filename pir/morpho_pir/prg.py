"""ChaCha PRG of docs/PROTOCOL.md section 2, vectorised over many seeds with NumPy."""
from __future__ import annotations

import numpy as np

CHACHA_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
PRG_ROUNDS = 8  # ChaCha8: 4 double rounds

_COLUMN_ROUNDS = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
_DIAGONAL_ROUNDS = ((0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))


def _rotl(v: np.ndarray, r: int, tmp: np.ndarray) -> None:
    np.left_shift(v, r, out=tmp)
    np.right_shift(v, 32 - r, out=v)
    np.bitwise_or(v, tmp, out=v)


def _quarter_round(x: list, a: int, b: int, c: int, d: int, tmp: np.ndarray) -> None:
    x[a] += x[b]
    x[d] ^= x[a]
    _rotl(x[d], 16, tmp)
    x[c] += x[d]
    x[b] ^= x[c]
    _rotl(x[b], 12, tmp)
    x[a] += x[b]
    x[d] ^= x[a]
    _rotl(x[d], 8, tmp)
    x[c] += x[d]
    x[b] ^= x[c]
    _rotl(x[b], 7, tmp)


def _permute(state: np.ndarray, rounds: int) -> np.ndarray:
    """state (16, M) u32 -> final state plus initial state, as (16, M) u32."""
    if rounds % 2:
        raise ValueError(f"rounds must be even, got {rounds}")
    out = state.copy()
    x = list(out)  # views of its rows: the rounds work in place, with no copy to gather after
    tmp = np.empty_like(x[0])
    for _ in range(rounds // 2):
        for a, b, c, d in _COLUMN_ROUNDS:
            _quarter_round(x, a, b, c, d, tmp)
        for a, b, c, d in _DIAGONAL_ROUNDS:
            _quarter_round(x, a, b, c, d, tmp)
    out += state
    return out


def chacha_block(
    key_words: np.ndarray, counter: int, nonce=(0, 0, 0), rounds: int = PRG_ROUNDS
) -> np.ndarray:
    """ChaCha block function (RFC 8439 2.3 layout) for M keys: (M, 8) u32 -> (M, 16) u32."""
    key_words = np.ascontiguousarray(key_words, dtype=np.uint32)
    if key_words.ndim != 2 or key_words.shape[1] != 8:
        raise ValueError(f"key_words must have shape (M, 8), got {key_words.shape}")
    m = key_words.shape[0]
    state = np.empty((16, m), dtype=np.uint32)
    state[0:4] = np.array(CHACHA_CONSTANTS, dtype=np.uint32)[:, None]
    state[4:12] = key_words.T
    state[12] = counter
    state[13:16] = np.array(nonce, dtype=np.uint32)[:, None]
    return _permute(state, rounds).T.copy()


def expand_words(seeds: np.ndarray):
    """expand() with the words first: seeds (4, M) u32 -> (left (4, M), right (4, M), t_left
    (M,), t_right (M,)); a caller that keeps this layout level after level (gen_key_pairs)
    transposes nothing."""
    m = seeds.shape[1]
    state = np.empty((16, 2 * m), dtype=np.uint32)
    state[0:4] = np.array(CHACHA_CONSTANTS, dtype=np.uint32)[:, None]
    state[4:8, :m] = seeds
    state[4:8, m:] = seeds
    state[8:12] = state[4:8]
    state[12, :m] = 0
    state[12, m:] = 1
    state[13:16] = 0
    out = _permute(state, PRG_ROUNDS)
    t_left = (out[0, m:] & 1).astype(np.uint8)
    t_right = (out[1, m:] & 1).astype(np.uint8)
    return out[0:4, :m], out[4:8, :m], t_left, t_right


def expand(seeds: np.ndarray):
    """PRG expansion of M seeds (M, 4) u32 -> (left (M,4), right (M,4), t_left (M,), t_right (M,)).

    Both blocks (counter 0 and 1) are computed in one vectorised pass.
    """
    seeds = np.ascontiguousarray(seeds, dtype=np.uint32)
    if seeds.ndim != 2 or seeds.shape[1] != 4:
        raise ValueError(f"seeds must have shape (M, 4), got {seeds.shape}")
    left, right, t_left, t_right = expand_words(seeds.T)
    return left.T.copy(), right.T.copy(), t_left, t_right

"""Batch key generation: byte for byte gen_keys (and PROTOCOL.md section 7), at >= 1,000 pairs/s."""
import csv
import subprocess
import sys
import time

import numpy as np
import pytest

from morpho_pir.dpf import DpfKey, eval_full, eval_point, gen_keys, key_length
from morpho_pir.keygen import gen_key_pairs, random_root_seeds
from tests.conftest import REPO
from tests.protocol_vectors import KEY0_HEX, KEY1_HEX, MASKS, ROOT0, ROOT1


def _roots(*pairs):
    return np.frombuffer(b"".join(a + b for a, b in pairs), dtype=np.uint8).reshape(-1, 2, 16)


def test_protocol_vector_keys():
    pairs = gen_key_pairs([42], 8, root_seeds=_roots((ROOT0, ROOT1)))
    assert pairs.key_hex(0) == [KEY0_HEX]
    assert pairs.key_hex(1) == [KEY1_HEX]
    assert pairs.key_bytes(0) == [bytes.fromhex(KEY0_HEX)]
    key0, key1 = pairs.pair(0)
    for x, (mask0, mask1) in MASKS.items():
        assert (eval_point(key0, x).hex(), eval_point(key1, x).hex()) == (mask0, mask1)


@pytest.mark.parametrize("d", range(1, 26))
def test_same_bytes_as_gen_keys_on_random_targets(d):
    rng = np.random.default_rng(100 + d)
    targets = [int(t) for t in rng.integers(0, 1 << d, size=9)]
    targets[0], targets[1] = 0, (1 << d) - 1  # both edges of the domain
    pairs = gen_key_pairs(targets, d, rng=rng)
    assert pairs.root_seeds.shape == (9, 2, 16)
    keys0, keys1 = pairs.key_bytes(0), pairs.key_bytes(1)
    for i, target in enumerate(targets):
        roots = (pairs.root_seeds[i, 0].tobytes(), pairs.root_seeds[i, 1].tobytes())
        key0, key1 = gen_keys(target, d, root_seeds=roots)
        assert (keys0[i], keys1[i]) == (key0.to_bytes(), key1.to_bytes()), (d, i, target)
        assert len(keys0[i]) == key_length(d)
        assert DpfKey.from_bytes(keys1[i], expected_domain_bits=d) == key1


def test_each_pair_is_a_point_function_in_a_full_evaluation():
    d, targets = 7, [0, 5, 5, 127, 64]
    pairs = gen_key_pairs(targets, d)
    masks = [eval_full(pairs.key_batch(party), 1 << d) for party in (0, 1)]
    xor = masks[0] ^ masks[1]
    for i, target in enumerate(targets):
        ones = np.flatnonzero((xor[i] != 0).any(axis=1))
        assert ones.tolist() == [target]
        assert (xor[i, target] == 0xFFFFFFFF).all()


def test_fresh_roots_differ_and_bad_input_is_refused():
    pairs = gen_key_pairs([3, 3], 4)
    assert len({pairs.root_seeds[i, p].tobytes() for i in (0, 1) for p in (0, 1)}) == 4
    assert random_root_seeds(5).shape == (5, 2, 16)
    with pytest.raises(ValueError, match=r"target 16 is outside \[0, 2\*\*4\)"):
        gen_key_pairs([1, 16], 4)
    with pytest.raises(ValueError, match=r"target -1 is outside"):
        gen_key_pairs([-1], 4)
    with pytest.raises(ValueError, match="domain_bits must be in 1..32, got 0"):
        gen_key_pairs([0], 0)
    with pytest.raises(ValueError, match=r"root_seeds must have shape \(2, 2, 16\)"):
        gen_key_pairs([0, 1], 4, root_seeds=np.zeros((1, 2, 16), dtype=np.uint8))
    with pytest.raises(ValueError, match="at least one target"):
        gen_key_pairs([], 4)


@pytest.mark.parametrize("d", [16, 25])
def test_a_96_key_batch_makes_over_1000_pairs_per_second(d):
    # About 13,000 pairs/s on a 2-CPU VM (`python benchmarks/keygen.py`); the floor is 1,000, so a
    # loaded CI machine still passes with the best of five batches.
    targets = list(range(96))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        pairs = gen_key_pairs(targets, d)
        pairs.key_hex(0), pairs.key_hex(1)
        best = min(best, time.perf_counter() - start)
    assert 96 / best >= 1000, f"{96 / best:.0f} key pairs/s"


@pytest.mark.processes
def test_benchmark_script_writes_its_csv(tmp_path):
    out = tmp_path / "keygen.csv"
    result = subprocess.run(
        [sys.executable, "benchmarks/keygen.py", "--domain-bits", "3", "--keys", "6",
         "--repeats", "2", "--python-repeats", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = out.read_text().splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [
        "# machine", "# shape", "# command", "# date"]
    assert lines[2] == ("# command: python benchmarks/keygen.py --domain-bits 3 --keys 6 "
                        f"--repeats 2 --python-repeats 1 --out {out}")
    rows = list(csv.DictReader(lines[4:]))
    assert [(r["method"], r["domain_bits"], r["keys"]) for r in rows] == [
        ("gen_keys", "3", "6"), ("vectorised", "3", "6")]
    assert all(float(r["pairs_per_s"]) > 0 for r in rows)

"""make_accounts: an Ethereum-like state in records files that build_records reads as they are."""
from __future__ import annotations

import json
import os

import pytest
from django.core.management import call_command

from gpu_engine.matrix import load_epoch
from morpho_pir.ethereum import (
    ACCOUNT_TYPE, ACCOUNT_VALUE_BYTES, CODE_CHUNK_BYTES, EMPTY_CODE_HASH, STORAGE_TYPE, Account,
    code_key, keccak256, state_key, state_value, storage_key,
)

MAX_U256 = (1 << 256) - 1


def test_keccak256_is_ethereums():
    assert keccak256(b"").hex() == \
        "c5d2460186f7233c927e7db2dcc703c0e500b653ca82273b7bfad8045d85a470"
    assert keccak256(b"abc").hex() == \
        "4e03657aea45a94fc7d47ba826c8d667c0d1e6e33a64a036ec44f58fa12d6c45"
    assert keccak256(b"The quick brown fox jumps over the lazy dog").hex() == \
        "4d741b6f1eb29cb2a9b9911c82f56fa8d73b04959d3d9d222895df6c0b28aa15"
    reference = pytest.importorskip("Crypto.Hash.keccak")
    for size in (135, 136, 137, 272, 1000, 5000):  # across the 136-byte block boundary
        data = os.urandom(size)
        assert keccak256(data) == reference.new(digest_bits=256, data=data).digest()


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_make_accounts_writes_the_same_state_for_the_same_seed(tmp_path):
    for name in ("a", "b"):
        call_command("make_accounts", "--accounts", "400", "--seed", "5", "--out",
                     str(tmp_path / name / "state.jsonl"))
    for suffix in ("", ".storage", ".code", ".state"):
        assert (tmp_path / "a" / f"state{suffix}.jsonl").read_bytes() == \
            (tmp_path / "b" / f"state{suffix}.jsonl").read_bytes()
    accounts = read_lines(tmp_path / "a" / "state.jsonl")
    storage = {line["key"]: line["value"]
               for line in read_lines(tmp_path / "a" / "state.storage.jsonl")}
    code = {line["key"]: line["value"] for line in read_lines(tmp_path / "a" / "state.code.jsonl")}
    assert len({line["address"] for line in accounts}) == 400
    assert {int(line["balance"], 16) for line in accounts} >= {0, MAX_U256}
    assert max(line["nonce"] for line in accounts) == (1 << 64) - 1
    contracts = [line for line in accounts if line["code"] != "0x"]
    assert 40 <= len(contracts) <= 130 and any(line["storage"] for line in contracts)
    for line in accounts:
        address = bytes.fromhex(line["address"][2:])
        assert line["key"] == line["address"] and len(address) == 20
        value = bytes.fromhex(line["value"][2:])
        assert len(value) == ACCOUNT_VALUE_BYTES
        body = bytes.fromhex(line["code"][2:])
        assert Account.decode(value) == Account(int(line["balance"], 16), line["nonce"],
                                                keccak256(body), len(body))
        for slot, slot_value in line["storage"].items():
            key = storage_key(address, bytes.fromhex(slot[2:]))
            assert storage["0x" + key.hex()] == slot_value
        chunks = [bytes.fromhex(code["0x" + code_key(keccak256(body), i).hex()][2:])
                  for i in range(-(-len(body) // CODE_CHUNK_BYTES))]
        assert b"".join(chunks)[:len(body)] == body
        if not body:
            assert Account.decode(value).code_hash == EMPTY_CODE_HASH
    # the state table holds every record of the three, its key prefixed with its type
    state = {line["key"]: (line["value"], line["type"])
             for line in read_lines(tmp_path / "a" / "state.state.jsonl")}
    assert len(state) == len(accounts) + len(storage) + len(code)
    for line in accounts[:50]:
        key = "0x" + state_key(ACCOUNT_TYPE, bytes.fromhex(line["key"][2:])).hex()
        assert state[key] == ("0x" + state_value(bytes.fromhex(line["value"][2:])).hex(), 1)
    for key, value in list(storage.items())[:50]:
        assert state["0x" + state_key(STORAGE_TYPE, bytes.fromhex(key[2:])).hex()][0][:66] == value


def test_build_records_reads_the_three_files_as_they_are(tmp_path):
    out = tmp_path / "state.jsonl"
    call_command("make_accounts", "--accounts", "300", "--seed", "2", "--out", str(out))
    shapes = (("", (20, 76)), (".storage", (52, 32)), (".code", (36, CODE_CHUNK_BYTES)),
              (".state", (53, 192)))
    for suffix, (key_bytes, value_bytes) in shapes:
        matrix = tmp_path / f"state{suffix}.bin"
        call_command("build_records", "--input", str(tmp_path / f"state{suffix}.jsonl"),
                     "--out", str(matrix), "--type-column", "type", "--seed", "1")
        records = load_epoch(matrix).records
        assert (records.key_bytes, records.value_bytes) == (key_bytes, value_bytes)

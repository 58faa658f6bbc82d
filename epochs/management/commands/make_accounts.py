"""`manage.py make_accounts --accounts N --seed S --out FILE`: an Ethereum-like state to serve.

Writes JSON Lines files that build_records reads as they are (columns key, value, type): the
accounts (FILE), their storage slots (FILE's stem + .storage.jsonl), the code of the contracts in
chunks (stem + .code.jsonl), and all three in one state table (stem + .state.jsonl, what the
JSON-RPC gateway serves from), laid out as morpho_pir.ethereum says. Account lines
also carry the account in words (address, balance, nonce, code, storage), the truth that tests
and demos compare lookups with. The same seed gives the same files.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from morpho_pir.ethereum import (
    ACCOUNT_TYPE, CODE_TYPE, MAX_CODE_BYTES, STORAGE_TYPE, Account, code_chunks, code_key,
    keccak256, state_key, state_value, storage_key,
)

MAX_U256 = (1 << 256) - 1
MAX_U64 = (1 << 64) - 1


def companion(out: Path, table: str) -> Path:
    """Where the storage or code records of accounts file `out` go."""
    return out.with_name(f"{out.stem}.{table}.jsonl")


def _balance(rng: random.Random, index: int) -> int:
    if index == 0:
        return MAX_U256  # the largest quantity a client must carry
    draw = rng.random()
    if draw < 0.1:
        return 0
    if draw < 0.7:
        return rng.randrange(10 ** 21)  # up to 1,000 ether, in wei
    if draw < 0.95:
        return rng.randrange(1 << 128)
    return rng.randrange(MAX_U256 + 1)


def _nonce(rng: random.Random, index: int) -> int:
    return MAX_U64 if index == 1 else rng.choice((0, 0, 1, rng.randrange(2, 1000)))


def _code(rng: random.Random) -> bytes:
    large = rng.random() >= 0.97
    size = rng.randrange(2048, MAX_CODE_BYTES + 1) if large else rng.randrange(1, 2048)
    return b"\x60\x80\x60\x40\x52" + rng.randbytes(max(0, size - 5))[:size - 5]


def _storage(rng: random.Random) -> dict:
    slots = {}
    for _ in range(rng.randrange(0, 17)):
        number = rng.randrange(10) if rng.random() < 0.5 else rng.getrandbits(256)
        slot = number.to_bytes(32, "big")
        slots[slot] = rng.randrange(1, MAX_U256 + 1).to_bytes(32, "big")
    return slots


def _line(key: bytes, value: bytes, record_type: int, **extra) -> str:
    return json.dumps({"key": "0x" + key.hex(), "value": "0x" + value.hex(), "type": record_type,
                       **extra}) + "\n"


class Command(BaseCommand):
    help = ("Write an Ethereum-like state (accounts, storage slots, contract code) as three JSON "
            "Lines files of records for build_records.")

    def add_arguments(self, parser):
        parser.add_argument("--accounts", type=int, required=True)
        parser.add_argument("--seed", type=int, default=0, help="same seed, same files")
        parser.add_argument("--contracts", type=float, default=0.2,
                            help="the fraction of accounts with code and storage (default 0.2)")
        parser.add_argument("--out", required=True,
                            help="the accounts file; storage and code go beside it "
                                 "(<stem>.storage.jsonl, <stem>.code.jsonl)")

    def handle(self, *args, accounts, seed, contracts, out, **options):
        if accounts < 1:
            raise CommandError(f"--accounts: expected at least 1, got {accounts}")
        if not 0 <= contracts <= 1:
            raise CommandError(f"--contracts: expected a fraction in 0..1, got {contracts}")
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        rng = random.Random(seed)
        seen_addresses, codes = set(), {}
        counts = {"storage": 0, "code": 0}
        with open(out, "w") as accounts_file, \
                open(companion(out, "storage"), "w") as storage_file, \
                open(companion(out, "code"), "w") as code_file, \
                open(companion(out, "state"), "w") as state_file:

            def record(kind: int, key: bytes, value: bytes, **extra) -> str:
                state_file.write(_line(state_key(kind, key), state_value(value), kind))
                return _line(key, value, kind, **extra)

            for index in range(accounts):
                address = rng.randbytes(20)
                while address in seen_addresses:
                    address = rng.randbytes(20)
                seen_addresses.add(address)
                code, storage = b"", {}
                if rng.random() < contracts:
                    # some contracts share their code, as clones of one template do
                    code = rng.choice(list(codes.values())) if codes and rng.random() < 0.3 \
                        else _code(rng)
                    storage = _storage(rng)
                account = Account(_balance(rng, index), _nonce(rng, index),
                                  keccak256(code), len(code))
                accounts_file.write(record(
                    ACCOUNT_TYPE, address, account.encode(), address="0x" + address.hex(),
                    balance=hex(account.balance), nonce=account.nonce, code="0x" + code.hex(),
                    storage={"0x" + s.hex(): "0x" + v.hex() for s, v in storage.items()}))
                for slot, value in storage.items():
                    storage_file.write(record(STORAGE_TYPE, storage_key(address, slot), value))
                    counts["storage"] += 1
                if code and account.code_hash not in codes:
                    codes[account.code_hash] = code
                    for chunk_index, chunk in enumerate(code_chunks(code)):
                        code_file.write(record(CODE_TYPE, code_key(account.code_hash, chunk_index),
                                               chunk))
                        counts["code"] += 1
        self.stdout.write(
            f"wrote {out} ({accounts} accounts), {companion(out, 'storage')} ({counts['storage']} "
            f"slots) and {companion(out, 'code')} ({counts['code']} chunks of {len(codes)} "
            f"contracts' code), and all of them in {companion(out, 'state')}")

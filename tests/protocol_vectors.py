"""The test vectors of docs/PROTOCOL.md section 7 and its answer formula, shared by the test modules."""
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from morpho_pir.dpf import KeyBatch, eval_pages
from gpu_engine.matrix import PageMatrix

ROOT0 = bytes(range(16))
ROOT1 = bytes(range(16, 32))
KEY0_HEX = (
    "000102030405060708090a0b0c0d0e0f000008cd3f287358a378bafc41832129e71706010075a9d9f3f4631d9b2aa574755d"
    "8cfdf800001315899305c42459b706932ad6433b08010056f16098290d53e7e905238f2c71622d0000e0daf3ec1783a293c4"
    "8350ccf16f690c00007e36e2384aef5b9fd0ea0b5441c09e1c00009888f8800eab3864bbc42d6d46292abf01006707eda7ef"
    "f2450d40b93cc15f1c98bd0100f22a6249b3678dddc1efbd8a7253a205"
)
KEY1_HEX = "101112131415161718191a1b1c1d1e1f0101" + KEY0_HEX[36:]
MASKS = {  # x -> (key0 mask, key1 mask)
    0: ("d189a817afeeddaa28cba218930bf82d",) * 2,
    41: ("7a14b0ca7a4678cc839e45c834a4d373",) * 2,
    42: ("7052d6288c2c90c221c9de84591059d2", "8fad29d773d36f3dde36217ba6efa62d"),
    43: ("43012fdff4e39945d158296a84ed735c",) * 2,
    255: ("aaa2398dda2902910c2a6659656c7858",) * 2,
}
ANSWER0_SHA256 = "b121b8e8fcd3b32edaa53de533cffc4e2237cddb2cac36d21ccc34c24bdb04b3"
ANSWER1_SHA256 = "67f5b6d8f09a7a45f207b4ed92f5d633538d6e0d9117e98a3395a87d17a756a4"
ANSWER0_PREFIX = "2d00d7182f7577e733c749242127bb6cbd00e7b8aff5c7c73307091451879b3c"

# Section 7, "v2 keys" (section 3.1): the same roots and target, d = 8, so a tree of depth 1.
V2_KEY0_HEX = (
    "000102030405060708090a0b0c0d0e0f00008208cd3f287358a378bafc41832129e717060100fc54124da50209a5"
    "eec4cb55c3353ded"
)
V2_KEY1_HEX = "101112131415161718191a1b1c1d1e1f0101" + V2_KEY0_HEX[36:]
V2_LEAVES = {  # leaf -> (key0 leaf, key1 leaf): leaf 0 differs in bit 42 alone (byte 5, 0x04)
    0: ("5cd42678f7d0ce4acbc573af6a2eea6b", "5cd42678f7d4ce4acbc573af6a2eea6b"),
    1: ("4f1fb139b34b7db24f47070e0c8c5dca",) * 2,
}
V2_ANSWER0_SHA256 = "26784051ddfc2287fa7bf60856f21866a9dc020f28272eff621c65b4cc757249"
V2_ANSWER1_SHA256 = "e25a57c8e502949cffb8e0a4be81bd9f4dbb1a22d889840ee0501b5d0969ebb2"
V2_ANSWER0_PREFIX = "b3a0fdc2b7a411f6bba8654affac599e83708d128734a106cb38f51a0f3ce92e"
# d = 2 (4 pages), target 3: a tree of depth 0, 36-byte keys whose leaf is the root
V2_SHORT_KEY0_HEX = "000102030405060708090a0b0c0d0e0f0000820218101010101010101010101010101010"
V2_SHORT_KEY1_HEX = "101112131415161718191a1b1c1d1e1f0101820218101010101010101010101010101010"



def _with_byte(key_hex: str, offset: int, value: int) -> str:
    return key_hex[:2 * offset] + f"{value:02x}" + key_hex[2 * offset + 2:]


# The keys docs/PROTOCOL.md section 7 names, as its "Refusals" table spells them
NAMED_KEYS = {"key0": KEY0_HEX, "key1": KEY1_HEX, "v2 key0": V2_KEY0_HEX, "v2 key1": V2_KEY1_HEX,
              "small v2 key0": V2_SHORT_KEY0_HEX, "small v2 key1": V2_SHORT_KEY1_HEX}
_KEY_TERM = re.compile(r"(?P<prefix>0[xX] \+ )?(?P<name>[a-z0-9 ]+?)(?P<cut>\[:\d+\])?"
                       r"(?: with byte (?P<byte>\d+) = 0x(?P<value>[0-9a-f]{2}))?"
                       r"(?P<upper> in upper case)?")
_ERROR = re.compile(r"`([^`]+)` `([^`]+)` `([^`]+)`")


class Refusal(NamedTuple):
    """One row of section 7's "Refusals": a request, the encodings it is sent in, what it gets."""
    label: str
    domain_bits: int  # of the epoch it is sent to: 8, the vector matrix, or 4
    queries: list  # each query's three keys as the JSON strings
    binary: bool  # sent in binary too, as the keys' bytes concatenated
    status: int
    errors: list  # (field, code, JSON message) each
    body_bytes: list  # binary: each error's "A to B"


def key_term(term: str) -> str:
    """A key of the table (`K`, `K with byte i = 0xNN`, `K[:n]`, `0X + K in upper case`) as the
    JSON string."""
    match = _KEY_TERM.fullmatch(term)
    if match is None or match["name"] not in NAMED_KEYS:
        raise ValueError(f"not a key of PROTOCOL.md section 7: {term!r}")
    key = NAMED_KEYS[match["name"]]
    if match["cut"]:
        key = key[:2 * int(match["cut"][2:-1])]
    if match["byte"]:
        key = _with_byte(key, int(match["byte"]), int(match["value"], 16))
    if match["upper"]:
        key = key.upper()
    return (match["prefix"] or "")[:2] + key


def key_bytes(key: str) -> bytes:
    return bytes.fromhex(key[2:] if key[:2] in ("0x", "0X") else key)


def read_refusals(text: str) -> list[Refusal]:
    """The rows of the "Refusals" table in the text of docs/PROTOCOL.md."""
    section = text[text.index("**Refusals.**"):text.index("## 8.")]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # past the header
    refusals = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        label, d, keys, sent, status, errors, body = cells
        queries = [[key_term(k) for k in re.findall(r"`([^`]+)`", query)]
                   for query in keys[1:-1].split("], [")]  # a `K[:n]` holds brackets
        assert sent in ("JSON", "both"), row
        refusals.append(Refusal(label, int(d), queries, sent == "both", int(status),
                                _ERROR.findall(errors), [] if body == "-" else body.split("; ")))
    return refusals


REFUSALS = read_refusals((Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text())


def vector_pages() -> np.ndarray:
    """The 200-page matrix whose page i byte j is (131*i + 17*j + 11) mod 256, as bytes."""
    i = np.arange(200)[:, None]
    j = np.arange(4096)[None, :]
    return ((131 * i + 17 * j + 11) % 256).astype(np.uint8)


def vector_matrix() -> PageMatrix:
    return PageMatrix(vector_pages().view("<u4").astype(np.uint32), domain_bits=8)


def protocol_answers(matrix: PageMatrix, keys: KeyBatch) -> np.ndarray:
    """Answers by docs/PROTOCOL.md section 4 written plainly, not by any backend's scan: XOR over
    pages of page AND the key's tiled mask (either key format); (K, 4096) u8."""
    masks = eval_pages(keys, matrix.num_pages)
    pages = matrix.block(0, matrix.num_pages).reshape(matrix.num_pages, 256, 4)
    return np.stack([np.bitwise_xor.reduce(pages & masks[k][:, None, :], axis=0).reshape(-1)
                     for k in range(len(keys))]).astype("<u4").view(np.uint8)


# Records tables (section 9): seed 0x0123456789abcdef, 1000 pages, 20-byte keys 00 01 .. 13,
# 32-byte values 40 41 .. 5f, type 2.
RECORDS_PARAMS = {"version": 1, "seed": 0x0123456789ABCDEF, "num_pages": 1000, "key_bytes": 20,
                  "value_bytes": 32}
RECORDS_KEY_HEX = bytes(range(20)).hex()
RECORDS_VALUE_HEX = bytes(range(0x40, 0x60)).hex()
RECORDS_TYPE = 2
RECORDS_HASH_INPUTS = [  # function i's SHA-256 input: domain, seed u64 LE, i, key
    "6d6f7270686f2d7265636f7264732f76312f70616765efcdab89674523010" + str(i) + RECORDS_KEY_HEX
    for i in range(3)]
RECORDS_WORDS = [8237258798539388198, 2840417314186642787, 13143381184239292439]
RECORDS_PAGES = (198, 191, 985)
RECORDS_FINGERPRINT = "0x5fc9131e303e909fa90b5395c362c269"
RECORDS_PARAMS_INPUT = ("6d6f7270686f2d7265636f7264732f76312f706172616d7301efcdab8967452301e80300"
                        "000000000014002000")
RECORDS_ROW_PREFIX = "02" + RECORDS_KEY_HEX + RECORDS_VALUE_HEX  # then 203 zero bytes
# 3 pages (each key's candidates are all three, in an order), 4-byte keys, no value: key "abcd"
RECORDS_SMALL = ({"version": 1, "seed": 7, "num_pages": 3, "key_bytes": 4, "value_bytes": 0},
                 b"abcd", (0, 2, 1), "0xf71b3e05d5ce8025ede3a575923a77fc")

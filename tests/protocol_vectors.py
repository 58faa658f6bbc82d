"""The test vectors of docs/PROTOCOL.md section 7 and its answer formula, shared by the test modules."""
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


# Refusals (docs/PROTOCOL.md section 7) on the d = 8 vector epoch: one query's three keys as hex
# -> the one error's field, code and words, the same in JSON and in binary (where the message
# adds the key's body bytes).
REFUSALS = {
    "v1 length, format byte 0x80": (
        [KEY0_HEX, _with_byte(KEY0_HEX, 18, 0x80), KEY0_HEX], "queries[0].keys[1]", "key_format",
        "format byte (byte 18) is 0x80"),
    "v1 length, format byte 0x81": (
        [KEY0_HEX, KEY1_HEX, _with_byte(KEY0_HEX, 18, 0x81)], "queries[0].keys[2]", "key_format",
        "format byte (byte 18) is 0x81"),
    "v1 length, format byte 0xff": (
        [KEY0_HEX, _with_byte(KEY0_HEX, 18, 0xFF), KEY0_HEX], "queries[0].keys[1]", "key_format",
        "format byte (byte 18) is 0xff"),
    "v2 length, format byte 0x80": (
        [V2_KEY0_HEX, _with_byte(V2_KEY0_HEX, 18, 0x80), V2_KEY1_HEX], "queries[0].keys[1]",
        "key_format", "format byte (byte 18) is 0x80"),
    "v1, domain_bits byte 0": (
        [KEY0_HEX, KEY1_HEX, _with_byte(KEY0_HEX, 18, 0)], "queries[0].keys[2]", "key_format",
        "domain_bits byte is 0, expected 1..32"),
    "v1 of the epoch's length, domain_bits byte 9": (
        [KEY0_HEX, _with_byte(KEY0_HEX, 18, 9), KEY0_HEX], "queries[0].keys[1]", "key_format",
        "key is 179 bytes but its domain_bits byte says 9, which needs 197 bytes"),
    "v2, domain_bits byte 40": (
        [V2_KEY0_HEX, _with_byte(V2_KEY0_HEX, 19, 40), V2_KEY0_HEX], "queries[0].keys[1]",
        "key_format", "v2 key's domain_bits byte (byte 19) is 40, expected 1..32"),
    "v2, party byte 2": (
        [V2_KEY0_HEX, V2_KEY1_HEX, _with_byte(V2_KEY0_HEX, 17, 2)], "queries[0].keys[2]",
        "key_format", "party byte is 2, expected 0 or 1"),
}


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

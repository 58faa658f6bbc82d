"""The facts client and server share: the protocol's sizes (docs/PROTOCOL.md) and hex parsing.

Plain Python with no imports beyond the standard library, so settings, the client and the engine
can all read it without loading NumPy. Everything else imports these names; nothing restates them.
"""
from __future__ import annotations

import re
from typing import Optional

PAGE_BYTES = 4096  # section 1: a page
ROW_BYTES = 256  # section 1: a row
ROWS_PER_PAGE = PAGE_BYTES // ROW_BYTES  # 16
KEYS_PER_QUERY = 3  # section 4: a query names three candidate pages, one key each
MAX_BATCH_QUERIES = 32  # section 5: queries in one batch request (a launch may merge several)
# Section 3: the key formats, by the names /epoch advertises them under (section 5.1). "v1" gives
# every page a 16-byte mask; "v2" stops the tree 7 levels early (section 3.1), a leaf selecting
# LEAF_PAGES pages by one bit each. Every server speaks both; a client picks v2 where offered.
KEY_FORMAT_NAMES = ("v1", "v2")
LEAF_PAGE_BITS = 7  # v2: log2 of the pages one leaf selects among
LEAF_PAGES = 1 << LEAF_PAGE_BITS  # 128: one selection bit each, the 128 bits of a leaf


def query_key_counts(key_count: int) -> tuple:
    """The engine's query_keys for `key_count` keys of whole queries: KEYS_PER_QUERY each."""
    return (KEYS_PER_QUERY,) * (key_count // KEYS_PER_QUERY)


_HEX_DIGITS = re.compile(r"[0-9a-fA-F]*")


class HexError(ValueError):
    """Text that is not the hex asked for; `code` names the rule it broke, as the API reports it."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def parse_hex(text, num_bytes: Optional[int] = None) -> bytes:
    """Hex digits with an optional 0x or 0X prefix -> bytes; with num_bytes, exactly that many.

    Digits only: whitespace anywhere is refused (bytes.fromhex alone would skip it). The messages
    are the ones the API and the admin show; with num_bytes, an odd count is a wrong length."""
    if not isinstance(text, str):
        raise HexError(f"expected a hex string, got {type(text).__name__}", "type")
    digits = text[2:] if text[:2] in ("0x", "0X") else text
    if num_bytes is None and len(digits) % 2:
        raise HexError(f"expected an even number of hex digits, got {len(digits)}", "odd_length")
    good = _HEX_DIGITS.match(digits).end()
    if good != len(digits):
        raise HexError(f"expected hex digits 0-9a-f, got {digits[good]!r} at position {good}",
                       "not_hex")
    if num_bytes is not None and len(digits) != 2 * num_bytes:
        raise HexError(f"expected {num_bytes} bytes ({2 * num_bytes} hex digits), got "
                       f"{len(digits)} hex digits", "length")
    return bytes.fromhex(digits)

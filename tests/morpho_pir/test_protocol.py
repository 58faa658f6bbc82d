"""morpho_pir.protocol: the one hex parser, strict on whitespace everywhere, and a NumPy-free import."""
from __future__ import annotations

import subprocess
import sys

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from morpho_pir.protocol import HexError, parse_hex
from morpho_pir.state import ServedState
from morpho_client.core import ServerError, unhex_page
from tests.conftest import REPO


@pytest.mark.parametrize("text", ["abCD", "0xabCD", "0XABcd"])
def test_hex_with_or_without_0x_in_either_case(text):
    assert parse_hex(text) == b"\xab\xcd"
    assert parse_hex(text, 2) == b"\xab\xcd"


@pytest.mark.parametrize("text, position", [(" abc", 0), ("ab c", 2), ("abc\n", 3),
                                            ("0x a", 0), ("a\tbc", 1)])
def test_whitespace_is_refused_wherever_it_stands(text, position):
    # bytes.fromhex alone would skip it; two spellings of one key must not both pass (an odd
    # count of characters is refused as such before the digits are read)
    for num_bytes in (None, 2):
        with pytest.raises(HexError) as caught:
            parse_hex(text, num_bytes)
        assert caught.value.code == "not_hex"
        assert str(caught.value).endswith(f"at position {position}")


def test_the_messages_and_codes_the_api_shows():
    cases = [
        (("abc",), "odd_length", "expected an even number of hex digits, got 3"),
        (("zz",), "not_hex", "expected hex digits 0-9a-f, got 'z' at position 0"),
        (("abc", 2), "length", "expected 2 bytes (4 hex digits), got 3 hex digits"),
        (("0x12", 32), "length", "expected 32 bytes (64 hex digits), got 2 hex digits"),
        ((12,), "type", "expected a hex string, got int"),
    ]
    for args, code, message in cases:
        with pytest.raises(HexError) as caught:
            parse_hex(*args)
        assert (caught.value.code, str(caught.value)) == (code, message)
        assert isinstance(caught.value, ValueError)


def test_the_callers_that_skipped_whitespace_refuse_it_now(tmp_path):
    with pytest.raises(CommandError, match="--state-root: expected 64 hex digits"):
        call_command("make_matrix", "--out", str(tmp_path / "m.bin"), "--pages", "2",
                     "--state-root", "00" * 16 + " " + "00" * 16)
    with pytest.raises(ValueError):
        ServedState.from_description({"epoch_id": 1, "updates": 0, "digest": "0x" + "00 " * 32})
    with pytest.raises(ServerError, match="page 0: not hex"):
        unhex_page("0x" + "00" * 2047 + " 0", "page 0")
    assert ServedState.from_description(
        {"epoch_id": 1, "updates": 0, "digest": "0X" + "AB" * 32}).digest == b"\xab" * 32


@pytest.mark.processes
def test_importing_the_constants_loads_no_numpy():
    # settings and the client read them; NumPy waits for whoever computes
    code = "import sys, morpho_pir.protocol; assert 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)

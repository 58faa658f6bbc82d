"""`?format=` against Accept on the query endpoints (docs/PROTOCOL.md section 5.3): the URL decides."""
from __future__ import annotations

import pytest

from tests.protocol_vectors import KEY0_HEX
from tests.queries.test_wire_format import BIN, SINGLE, api, post  # noqa: F401 - api: the fixture

V1 = bytes.fromhex(KEY0_HEX)


@pytest.mark.parametrize("query, accept, answered", [
    ("?format=binary", "application/json", BIN), ("?format=json", BIN, "application/json"),
    ("?format=binary", None, BIN), ("", BIN, BIN), ("", None, "application/json"),
])
def test_format_in_the_url_decides_over_accept(api, query, accept, answered):
    response = post(api, SINGLE + query, V1 * 3, accept=accept)
    assert response.status_code == 200 and response["Content-Type"] == answered


@pytest.mark.parametrize("query, got", [("?format=xml", "'xml'"), ("?format=JSON", "'JSON'"),
                                        ("?format=", "''"),
                                        ("?format=json&format=binary", "['json', 'binary']")])
def test_an_unknown_format_is_a_400_naming_both(api, query, got):
    response = post(api, SINGLE + query, V1 * 3, accept=BIN)
    assert response.status_code == 400 and response["Content-Type"] == "application/json"
    (error,) = response.json()["errors"]
    assert (error["field"], error["code"], error["message"]) == (
        "format", "invalid", f"expected one of json, binary, got {got}")

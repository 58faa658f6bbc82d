"""OpenAPI (drf-spectacular) additions of the query endpoints: their request and response bodies
in both encodings, which their views build by hand, so clients and the fuzz tests see the whole
contract (the error responses of every operation: morphoweb/openapi.py)."""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, inline_serializer
from rest_framework import serializers

from morpho_pir.protocol import KEY_FORMAT_NAMES
from queries.api.binary import (ANSWER_BYTES, DIGEST_HEADER, EPOCH_HEADER, OCTET_STREAM,
                                QUERIES_HEADER, UPDATES_HEADER)
from queries.api.serializers import BatchQuerySerializer, PageQuerySerializer

_HEX_PAGE = serializers.CharField(help_text="One 4096-byte answer as 0x-prefixed lower-case hex.")
_PAGES = serializers.ListField(child=_HEX_PAGE, min_length=1,
                               help_text="One answer per key of the query, in key order.")

STATE = inline_serializer("ServedState", {
    "epoch_id": serializers.IntegerField(),
    "updates": serializers.IntegerField(min_value=0, help_text="Rows written over the epoch's file."),
    "digest": serializers.CharField(help_text="32 bytes as 0x hex: XOR over the written rows of "
                                    "SHA-256(row as u64 LE || its 256 bytes)."),
}, help_text="What the answers come from (docs/PROTOCOL.md section 6): a client XORs only answers "
             "of equal states.")

EPOCH_RESPONSE = inline_serializer("EpochInfo", {
    "epoch_id": serializers.IntegerField(),
    "num_rows": serializers.IntegerField(),
    "seeds": serializers.ListField(child=serializers.IntegerField(min_value=0), min_length=3, max_length=3),
    "block_number": serializers.IntegerField(),
    "state_root": serializers.CharField(help_text="32 bytes as 0x hex"),
    "page_pir": inline_serializer("PagePir", {
        "domain_bits": serializers.IntegerField(),
        "rows_per_page": serializers.IntegerField(),
        "num_pages": serializers.IntegerField(),
        "page_size_bytes": serializers.IntegerField(),
    }),
    "encodings": serializers.ListField(
        child=serializers.ChoiceField(choices=["json", "binary"]),
        help_text='The encodings the query endpoints speak: "json" (hex) and "binary" '
                  f"({OCTET_STREAM})."),
    "key_formats": serializers.ListField(
        child=serializers.ChoiceField(choices=list(KEY_FORMAT_NAMES)),
        help_text='The DPF key formats the query endpoints take (docs/PROTOCOL.md section 3): "v1" '
                  '(a 16-byte mask a page) and "v2" (section 3.1: the tree stops 7 levels early, '
                  "a leaf selects among 128 pages). A server that does not list it takes v1 only."),
    "state": STATE,
})

PAGE_RESPONSE = inline_serializer("PageAnswer", {
    "epoch_id": serializers.IntegerField(help_text="The epoch every answer was computed against."),
    "pages": _PAGES,
})

BATCH_RESPONSE = inline_serializer("BatchAnswer", {
    "epoch_id": serializers.IntegerField(help_text="The one epoch all queries were answered against."),
    "results": serializers.ListField(child=inline_serializer("QueryAnswer", {"pages": _PAGES})),
})


# --- The binary encoding (docs/PROTOCOL.md section 5.3) ------------------------------------------

def _binary_keys(count: str) -> dict:
    return {"type": "string", "format": "binary", "description": (
        f"{count}: the DPF keys as raw bytes, concatenated, 3 per query in key order, each "
        "35 + 18 * domain_bits bytes (domain_bits of GET /epoch), or all v2 keys of "
        "36 + 18 * max(domain_bits - 7, 0) bytes (their byte 18 is 0x82); the length gives the count.")}


_ANSWERS = (
    "JSON (hex) by default. With Accept: application/octet-stream, binary: every query's 3 "
    f"answers of 4096 bytes concatenated in request order ({ANSWER_BYTES} bytes a query), the "
    f"epoch in {EPOCH_HEADER} and the count in {QUERIES_HEADER}.")
_BINARY_ANSWERS = OpenApiResponse(OpenApiTypes.BINARY, description=_ANSWERS)

PAGE_REQUEST = {"application/json": PageQuerySerializer, OCTET_STREAM: _binary_keys("One query")}
BATCH_REQUEST = {"application/json": BatchQuerySerializer,
                 OCTET_STREAM: _binary_keys("1 to MORPHO_MAX_BATCH queries")}
PAGE_RESPONSE = {(200, "application/json"): OpenApiResponse(PAGE_RESPONSE, description=_ANSWERS),
                 (200, OCTET_STREAM): _BINARY_ANSWERS}
BATCH_RESPONSE = {(200, "application/json"): OpenApiResponse(BATCH_RESPONSE, description=_ANSWERS),
                  (200, OCTET_STREAM): _BINARY_ANSWERS}


def response_headers(*headers: tuple[str, type, str]) -> list:
    """(name, type, description) of each header a 200 response carries, as drf-spectacular
    documents them."""
    return [OpenApiParameter(name, kind, OpenApiParameter.HEADER, response=[200], description=text)
            for name, kind, text in headers]


def binary_answer_headers() -> list:
    """The response headers of an answer: the served state in both encodings, the epoch and count
    in binary ones (a JSON answer carries those in its body)."""
    return response_headers(
        (EPOCH_HEADER, int, "Binary answers: the epoch all answers were computed on."),
        (QUERIES_HEADER, int, "Binary answers: the number of queries answered."),
        (UPDATES_HEADER, int, "Both encodings: rows written over the epoch (served state)."),
        (DIGEST_HEADER, str, "Both encodings: the written rows' digest, 0x hex (served state, "
                             "docs/PROTOCOL.md section 6)."),
    )

"""The binary encoding of the query API (docs/PROTOCOL.md section 5.3): raw key bytes in, raw
answers out, errors still JSON; the key checks are the JSON path's own (key_from_bytes)."""
from __future__ import annotations

import math

from django.conf import settings
from django.utils.http import parse_header_parameters
from rest_framework import exceptions, serializers
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.utils.mediatypes import media_type_matches

from morpho_pir.dpf import (
    FORMAT_BYTE, KEY_FORMAT_V1, KEY_FORMAT_V2, V2_MARKER, KeyBatch, KeyFormatError,
    format_byte_problem, key_domain_bits, key_format_of, key_length,
)
from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES
from queries.api.serializers import KEY_FORMATS, format_message, key_from_bytes, key_shape

OCTET_STREAM = "application/octet-stream"
EPOCH_HEADER = "X-Morpho-Epoch-Id"  # the epoch all answers of a binary response were computed on
QUERIES_HEADER = "X-Morpho-Queries"  # how many queries a binary response answers
# the served state of an answer, JSON or binary (docs/PROTOCOL.md section 6): rows written over the
# epoch and their digest, which a client compares between the two parties before it XORs
UPDATES_HEADER = "X-Morpho-State-Updates"
DIGEST_HEADER = "X-Morpho-State-Digest"
# Bulk results may span epochs (each chunk is answered within one): all of them, and which
# queries each answered as `first-last=epoch_id`, comma-separated.
EPOCH_IDS_HEADER = "X-Morpho-Epoch-Ids"
EPOCH_RANGES_HEADER = "X-Morpho-Epoch-Ranges"
ANSWER_BYTES = KEYS_PER_QUERY * PAGE_BYTES  # one query's three answers: 12,288 bytes


class OctetStreamParser(BaseParser):
    """A binary body: keys concatenated, three per query (read whole; the body limit bounds it)."""

    media_type = OCTET_STREAM

    def parse(self, stream, media_type=None, parser_context=None) -> bytes:
        return stream.read()


class OctetStreamRenderer(BaseRenderer):
    """Answers as raw bytes, for clients whose Accept asks for application/octet-stream."""

    media_type = OCTET_STREAM
    format = "binary"
    charset = None
    render_style = "binary"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        return data


class QualityNegotiation(DefaultContentNegotiation):
    """DRF's negotiation, but where the client gives q-values they rank the renderers: each
    renderer gets the q of the most specific media range it matches, the highest wins (ties: the
    more specific range, then the renderer order, JSON first). So `application/octet-stream,
    application/json;q=0.5` answers binary and `application/octet-stream;q=0.2, */*` JSON, where
    DRF alone ignores q. Without q-values this is exactly DRF's choice.

    `?format=` names one of the view's renderers and then decides, whatever Accept says (a URL
    that says what it wants needs no header); an empty, unknown or repeated one is a 400.
    """

    def select_renderer(self, request, renderers, format_suffix=None):
        name = self.settings.URL_FORMAT_OVERRIDE
        values = request.query_params.getlist(name) if name else []
        if values:
            chosen = [r for r in renderers if len(values) == 1 and r.format == values[0]]
            if not chosen:
                known = ", ".join(renderer.format for renderer in renderers)
                got = repr(values) if len(values) > 1 else repr(values[0])
                raise exceptions.ValidationError({name: [f"expected one of {known}, got {got}"]})
            return chosen[0], chosen[0].media_type
        tokens = self.get_accept_list(request)  # DRF's own bounded tokenizer
        if format_suffix or not any("q=" in token for token in tokens):
            return super().select_renderer(request, renderers, format_suffix)
        ranges = []
        for token in tokens:
            try:
                media, params = parse_header_parameters(token)
                quality = float(params.get("q", 1))
            except ValueError:
                continue
            main, _, sub = media.partition("/")
            specific = 0 if main == "*" else 1 if sub == "*" else 2 + any(k != "q" for k in params)
            ranges.append((token, quality if math.isfinite(quality) else 0.0, specific))
        best = None
        for order, renderer in enumerate(renderers):
            matches = [(specific, quality, token) for token, quality, specific in ranges
                       if media_type_matches(renderer.media_type, token)]
            if not matches:
                continue
            specific, quality, token = max(matches, key=lambda match: match[0])
            rank = (quality, specific, -order)
            if quality > 0 and (best is None or rank > best[0]):
                media = token if specific >= 2 else renderer.media_type
                best = (rank, renderer, media)
        if best is None:
            raise exceptions.NotAcceptable(available_renderers=renderers)
        return best[1], best[2]


def sent_binary(request) -> bool:
    """Whether the request's body goes to the binary parser (the parser DRF itself picks)."""
    parser = request.negotiator.select_parser(request, request.parsers)
    return isinstance(parser, OctetStreamParser)


def wants_binary(request) -> bool:
    """Whether content negotiation chose binary answers for this request."""
    return isinstance(getattr(request, "accepted_renderer", None), OctetStreamRenderer)


def body_bytes(data) -> bytes:
    # DRF skips the parser for an empty body and hands an empty dict instead.
    return data if isinstance(data, (bytes, bytearray)) else b""


def query_bytes(domain_bits: int, key_format: int = KEY_FORMAT_V1) -> int:
    """Bytes of one query in a binary body: three keys of 35 + 18 * domain_bits bytes (v1), of
    36 + 18 * max(domain_bits - 7, 0) (v2)."""
    return KEYS_PER_QUERY * key_length(domain_bits, key_format)


def first_key_error(message: str, single: bool) -> serializers.ValidationError:
    """An error of the body's first key, named as the JSON encoding names it."""
    keys = {"keys": {0: [serializers.ErrorDetail(message, code="key_format")]}}
    return serializers.ValidationError(keys if single else {"queries": {0: keys}})


def check_body(raw: bytes, domain_bits: int, lo: int, hi: int, *, single: bool = False,
               limit_setting: str = "", key_formats=KEY_FORMATS) -> int:
    """The number of queries in a binary body, or a ValidationError naming the length or count.
    The keys' format is the first key's (byte 18), one of `key_formats`: a byte 18 that names no
    format is that key's error, since the body cannot be cut into keys without one."""
    problem = format_byte_problem(raw)
    if problem:
        raise first_key_error(f"{problem} (body bytes 0 to {FORMAT_BYTE})", single)
    key_format = key_format_of(raw)
    if key_format not in key_formats:
        raise serializers.ValidationError(
            {"body": [serializers.ErrorDetail(format_message(key_format, key_formats),
                                              code="key_format")]})
    size = query_bytes(domain_bits, key_format)
    shape = (f"{KEYS_PER_QUERY} keys of {key_length(domain_bits, key_format)} bytes: "
             f"{key_shape(domain_bits, key_format)}")
    if single and len(raw) != size:
        message = f"expected {size} bytes (one query, {shape}), got {len(raw)}"
    elif len(raw) % size:
        message = (f"expected a multiple of {size} bytes (one query is {shape}), "
                   f"got {len(raw)}")
    else:
        count = len(raw) // size
        if not lo <= count <= hi:
            setting = f" ({limit_setting})" if limit_setting else ""
            raise serializers.ValidationError({"queries": [serializers.ErrorDetail(
                f"expected {lo} to {hi} queries{setting}, got {count}", code="count")]})
        return count
    if len(raw) > 18 + (key_format != KEY_FORMAT_V1) and key_domain_bits(raw) != domain_bits:
        # The likeliest cause: keys made for another epoch's domain.
        message += (f"; the first key's domain_bits byte is {key_domain_bits(raw)}, this server's "
                    f"epoch has domain_bits {domain_bits}")
    if key_format == KEY_FORMAT_V1 and KEY_FORMAT_V2 in key_formats:
        # the format is read from byte 18: a body meant as v2 whose marker is off reads as v1
        message += (f"; v2 keys (byte 18 = 0x{V2_MARKER:02x}) are "
                    f"{query_bytes(domain_bits, KEY_FORMAT_V2)} bytes a query")
    raise serializers.ValidationError(
        {"body": [serializers.ErrorDetail(message, code="body_length")]})


def parse_query(raw: bytes, index: int, domain_bits: int,
                key_formats=KEY_FORMATS) -> tuple[list[bytes], dict]:
    """Query `index` of a checked body: its keys, and {key index: [error]} for each bad key.
    Every key is of the body's format, its first key's."""
    key_format = key_format_of(raw)
    length = key_length(domain_bits, key_format)
    keys: list[bytes] = []
    errors: dict = {}
    for key in range(KEYS_PER_QUERY):
        start = (index * KEYS_PER_QUERY + key) * length
        try:
            keys.append(key_from_bytes(bytes(raw[start:start + length]), domain_bits, key_formats,
                                       key_format))
        except serializers.ValidationError as exc:
            (detail,) = exc.detail
            errors[key] = [serializers.ErrorDetail(
                f"{detail} (body bytes {start} to {start + length - 1})", code=detail.code)]
    return keys, errors


def binary_queries(raw: bytes, domain_bits: int, lo: int, hi: int,
                   single: bool, key_formats=KEY_FORMATS) -> KeyBatch:
    """Every query's three keys as one batch, or one ValidationError naming each bad query and key.

    The whole body is checked in one vectorised pass; only a body that fails it is parsed key by
    key, for errors that name every bad key as the JSON encoding's do."""
    count = check_body(raw, domain_bits, lo, hi, single=single, key_formats=key_formats)
    try:
        return KeyBatch.from_bytes(raw, domain_bits)
    except KeyFormatError as exc:
        first_failure = exc
    errors: dict = {}
    for index in range(count):
        _, bad = parse_query(raw, index, domain_bits, key_formats)
        if bad:
            errors[index] = {"keys": bad}
    if not errors:  # the two checks disagree: a bug, but never an answer to keys we doubt
        raise AssertionError(f"a body failed the batch key check only: {first_failure}")
    # The JSON serializers' shapes, so the errors flatten to the same fields and indices.
    raise serializers.ValidationError(errors[0] if single else {"queries": errors})


class BinaryPageQuerySerializer(serializers.BaseSerializer):
    """One query as 3 raw keys; validated data: `{"key_batch": KeyBatch}` of its keys."""

    def to_internal_value(self, data) -> dict:
        raw = body_bytes(data)
        return {"key_batch": binary_queries(raw, self.context["domain_bits"], 1, 1, single=True,
                                            key_formats=self.context.get("key_formats", KEY_FORMATS))}


class BinaryBatchQuerySerializer(serializers.BaseSerializer):
    """1 to MORPHO_MAX_BATCH queries of 3 raw keys; validated data: `{"key_batch": KeyBatch}`."""

    def to_internal_value(self, data) -> dict:
        raw = body_bytes(data)
        return {"key_batch": binary_queries(raw, self.context["domain_bits"], 1,
                                            settings.MORPHO_MAX_BATCH, single=False,
                                            key_formats=self.context.get("key_formats", KEY_FORMATS))}


def state_headers(state) -> dict:
    """The served state of an answer as headers, in either encoding (a JSON body stays as it was)."""
    return {UPDATES_HEADER: str(state.updates), DIGEST_HEADER: "0x" + state.digest.hex()}


def binary_answer(result) -> Response:
    """A binary response: every query's three 4096-byte answers concatenated in request order,
    the epoch, count and served state in headers (result: the engine's BatchAnswer)."""
    return Response(result.answers.tobytes(), content_type=OCTET_STREAM, headers={
        EPOCH_HEADER: str(result.epoch_id), QUERIES_HEADER: str(len(result.query_keys)),
        **state_headers(result.state)})


def answered_queries(response) -> int:
    """Queries a successful batch response answers, in either encoding (for the metrics)."""
    if isinstance(response.data, (bytes, bytearray)):
        return len(response.data) // ANSWER_BYTES
    return response.data.queries  # an AnswerBody


class JSONErrorsMixin:
    """For views that speak both encodings: errors are JSON even where binary answers were asked."""

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        if (isinstance(response, Response)
                and isinstance(response.accepted_renderer, OctetStreamRenderer)
                and not isinstance(response.data, (bytes, bytearray))):
            # A 4xx or 503 (a dict) renders as JSON: a client that asked for bytes still reads why.
            response.accepted_renderer = JSONRenderer()
            response.accepted_media_type = JSONRenderer.media_type
        return response

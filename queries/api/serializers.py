"""Serializers of the PIR API: hex DPF keys in, hex pages out, errors naming field and values."""
from __future__ import annotations

import binascii
from typing import Optional

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from morpho_pir.dpf import (
    FORMAT_BYTE, KEY_FORMAT_V1, KEY_FORMAT_V2, MAX_DOMAIN_BITS, V2_MARKER, DpfKey, KeyBatch,
    KeyFormatError, format_byte_problem, format_name, key_domain_bits, key_format_of, key_length,
)
from morpho_pir.protocol import KEYS_PER_QUERY, HexError, parse_hex

# The encodings the query endpoints speak (docs/PROTOCOL.md section 5), advertised in /epoch.
ENCODINGS = ("json", "binary")
# The key formats they take (section 3: v1, section 3.1: v2), advertised in /epoch too.
KEY_FORMATS = (KEY_FORMAT_V1, KEY_FORMAT_V2)
V2_MARKER_HEX = f"{V2_MARKER:02x}"  # byte 18 of a v2 key, as the hex of a JSON body spells it


def json_type(value) -> str:
    """The JSON name of a parsed value's type, for 'expected X, got Y' messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def to_hex(data: bytes) -> str:
    """Response encoding: 0x-prefixed lower-case hex."""
    return "0x" + bytes(data).hex()


def _strict_list(data, what: str, lo: int, hi: int) -> list:
    # Checked before any element is parsed, so an oversized list costs nothing, and the
    # message carries the count that was sent.
    if not isinstance(data, list):
        raise serializers.ValidationError(
            f"expected an array of {what}, got {json_type(data)}", code="not_a_list"
        )
    if not lo <= len(data) <= hi:
        expected = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise serializers.ValidationError(
            f"expected {expected} {what}, got {len(data)}", code="count"
        )
    return data


def key_shape(domain_bits: int, key_format: int) -> str:
    """How a key's length follows from domain_bits, for messages: "35 + 18 * domain_bits 8"."""
    if key_format == KEY_FORMAT_V1:
        return f"35 + 18 * domain_bits {domain_bits}"
    return f"a v2 key: 36 + 18 * max(domain_bits {domain_bits} - 7, 0)"


NOT_TAKEN = "GET /epoch lists the key formats this server takes, and bulk jobs take v1 keys only"
MIXED = "a request's keys share its first key's format"


def format_message(got: int, expected, why: str = NOT_TAKEN) -> str:
    """The message of a key in a format the request cannot take, and why."""
    return (f"key format: a {format_name(got)} key, expected "
            f"{' or '.join(format_name(f) for f in expected)}: {why}")


def request_format(raw) -> Optional[int]:
    """The format of a request: the one byte 18 of its first key names (docs/PROTOCOL.md section
    5.4), or None when that key has no byte 18 or it names no format."""
    if raw is None or len(raw) <= FORMAT_BYTE or format_byte_problem(raw):
        return None
    return key_format_of(raw)


def first_key_bytes(value) -> Optional[bytes]:
    """A JSON request's first key as bytes, or None where it is not a hex string."""
    try:
        return parse_hex(value)
    except HexError:
        return None


def _implied_length(raw: bytes, key_format: int) -> Optional[int]:
    """The length a key's own domain_bits byte implies, or None when that byte is out of range."""
    own = key_domain_bits(raw)
    return key_length(own, key_format) if 1 <= own <= MAX_DOMAIN_BITS else None


def key_from_bytes(raw: bytes, domain_bits: int, key_formats=KEY_FORMATS,
                   requested: Optional[int] = None) -> bytes:
    """One key's bytes checked against the server's domain_bits: the one key check of both
    encodings (hex in JSON, raw in binary), a ValidationError coded as the API documents, by the
    rules of docs/PROTOCOL.md section 5.4 in their order. Either key format (byte 18 tells), of
    those in `key_formats`, and the request's (`requested`, its first key's; None: it has none).
    Returns the bytes, which travel on to the engine as they are."""
    if len(raw) <= FORMAT_BYTE:  # no format of its own: measured by the request's
        key_format = requested or KEY_FORMAT_V1
        raise serializers.ValidationError(
            f"key length: expected {key_length(domain_bits, key_format)} bytes "
            f"({key_shape(domain_bits, key_format)}), got {len(raw)}", code="key_length")
    problem = format_byte_problem(raw)
    if problem:
        raise serializers.ValidationError(problem, code="key_format")
    key_format = key_format_of(raw)
    if key_format not in key_formats:
        raise serializers.ValidationError(format_message(key_format, key_formats), code="key_format")
    if requested is not None and key_format != requested:
        raise serializers.ValidationError(format_message(key_format, (requested,), MIXED),
                                          code="key_format")
    expected_len = key_length(domain_bits, key_format)
    # The length is checked against the server's domain first, so that a key sized for
    # another domain is reported as such rather than as a bad byte inside it: a key whose
    # domain_bits byte is not the epoch's, and whose length is not the epoch's key length or is
    # the one its own byte implies (v2 keys of every d <= 7 are 36 bytes).
    has_domain_byte = len(raw) > FORMAT_BYTE + (key_format == KEY_FORMAT_V2)
    if (has_domain_byte and key_domain_bits(raw) != domain_bits
            and (len(raw) != expected_len or len(raw) == _implied_length(raw, key_format))):
        raise serializers.ValidationError(
            f"domain_bits: expected {domain_bits} (this server's epoch), got "
            f"{key_domain_bits(raw)} (a {'v2 ' if key_format == KEY_FORMAT_V2 else ''}key of "
            f"{len(raw)} bytes)",
            code="domain_bits",
        )
    if len(raw) != expected_len:
        raise serializers.ValidationError(
            f"key length: expected {expected_len} bytes ({key_shape(domain_bits, key_format)}), "
            f"got {len(raw)}",
            code="key_length",
        )
    try:
        DpfKey.check(raw, expected_domain_bits=domain_bits)
    except KeyFormatError as exc:
        raise serializers.ValidationError(str(exc), code="key_format") from None
    return bytes(raw)


def keys_checked_at_once(queries, domain_bits: int, key_formats=KEY_FORMATS) -> Optional[KeyBatch]:
    """The keys of JSON queries that are all well formed (`{"keys": [3 hex keys]}` each, all in
    the first key's format, one of `key_formats`), checked in one vectorised pass; None when
    anything is off, and the caller then validates field by field to name every error. It
    accepts only what the field-by-field check accepts, with the same keys: digits with an
    optional 0x, the length of a key of this domain, and the checks of DpfKey.check
    (KeyBatch.from_bytes makes the same ones for every key at once)."""
    digits = []
    width = key_format = None
    for query in queries:
        keys = query.get("keys") if type(query) is dict else None
        if type(keys) is not list or len(keys) != KEYS_PER_QUERY:
            return None
        for key in keys:
            if type(key) is not str:
                return None
            key = key[2:] if key[:2] in ("0x", "0X") else key
            if width is None:  # the request's format: its first key's byte 18
                key_format = KEY_FORMAT_V2 if key[36:38].lower() == V2_MARKER_HEX else KEY_FORMAT_V1
                if key_format not in key_formats:
                    return None
                width = 2 * key_length(domain_bits, key_format)
            if len(key) != width:
                return None
            digits.append(key)
    try:
        raw = binascii.unhexlify("".join(digits))  # hex digits only: no spaces, no signs
        batch = KeyBatch.from_bytes(raw, domain_bits)
    except (ValueError, KeyFormatError):  # binascii.Error is a ValueError
        return None
    return batch if batch.key_format == key_format else None


def checked_batch(keys) -> KeyBatch:
    """The request's keys as one KeyBatch, the form the engine takes, from keys key_from_bytes
    passed one by one (of the request's format and this server's domain): parsed, not checked
    again."""
    raw = b"".join(keys)
    return KeyBatch.from_bytes(raw, key_domain_bits(raw), trusted=True)


@extend_schema_field({"type": "string", "description": "one DPF key as hex (0x optional): "
                       "35 + 18 * domain_bits bytes (v1) or 36 + 18 * max(domain_bits - 7, 0) "
                       "(v2), domain_bits of GET /epoch (docs/PROTOCOL.md section 3)"})
class DpfKeyField(serializers.Field):
    """One DPF key as hex (with or without 0x), checked against the server's domain_bits; its
    validated value is the key's bytes."""

    default_error_messages = {
        "required": "expected a hex-encoded DPF key, got nothing",
        "null": "expected a hex-encoded DPF key, got null",
    }

    def to_internal_value(self, data) -> bytes:
        if not isinstance(data, str):
            raise serializers.ValidationError(
                f"expected a hex string, got {json_type(data)}", code="type"
            )
        try:
            raw = parse_hex(data)  # digits only: a key holds no spaces
        except HexError as exc:
            raise serializers.ValidationError(str(exc), code=exc.code) from None
        return key_from_bytes(raw, self.context["domain_bits"],
                              self.context.get("key_formats", KEY_FORMATS),
                              self.context.get("request_format"))

    def to_representation(self, value) -> str:
        return to_hex(value if isinstance(value, (bytes, bytearray)) else value.to_bytes())


class KeyListField(serializers.ListField):
    """Exactly three keys: the query's three candidate pages."""

    default_error_messages = {
        "required": f"expected an array of {KEYS_PER_QUERY} hex-encoded DPF keys, got nothing",
        "null": f"expected an array of {KEYS_PER_QUERY} hex-encoded DPF keys, got null",
    }

    def __init__(self, **kwargs):
        # The bounds are _strict_list's (checked first, with the API's words); given here too,
        # they are what the OpenAPI schema says (minItems, maxItems).
        super().__init__(child=DpfKeyField(), min_length=KEYS_PER_QUERY, max_length=KEYS_PER_QUERY,
                         **kwargs)

    def to_internal_value(self, data):
        _strict_list(data, "keys", KEYS_PER_QUERY, KEYS_PER_QUERY)
        return super().to_internal_value(data)


class JsonObjectSerializer(serializers.Serializer):
    """A serializer whose body must be a JSON object; anything else is named in the error."""

    def validate_empty_values(self, data):
        if data is None:  # else DRF's own words: "This field may not be null." / "No data provided"
            raise serializers.ValidationError(
                {"non_field_errors": [serializers.ErrorDetail("expected a JSON object, got null",
                                                              code="null")]})
        return super().validate_empty_values(data)

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": [f"expected a JSON object, got {json_type(data)}"]},
                code="invalid",
            )
        return super().to_internal_value(data)

    def run_validators(self, value):
        # These bodies have no read-only fields and no serializer-level validators: DRF's own
        # run_validators would build (deep-copy) every field only to find no read-only default,
        # about a tenth of a single query's web CPU under cProfile when the keys were checked
        # at once.
        if self.validators or any(field.read_only for field in self._declared_fields.values()):
            super().run_validators(value)


def _first(items):
    return items[0] if type(items) is list and items else None


def note_request_format(context: dict, first_key) -> None:
    """Put the request's format (its first key's, or None) where every DpfKeyField reads it."""
    context["request_format"] = request_format(
        first_key_bytes(first_key) if isinstance(first_key, str) else None)


class PageQuerySerializer(JsonObjectSerializer):
    """One query: `{"keys": [k0, k1, k2]}`, its keys of one format."""

    keys = KeyListField()

    def to_internal_value(self, data):
        if self.parent is None:  # a request's whole body (in a batch, the batch checks at once)
            batch = keys_checked_at_once([data], self.context["domain_bits"],
                                         self.context.get("key_formats", KEY_FORMATS))
            if batch is not None:
                size = len(batch.raw) // KEYS_PER_QUERY
                return {"keys": [batch.raw[i * size:(i + 1) * size] for i in range(KEYS_PER_QUERY)],
                        "key_batch": batch}
            note_request_format(self.context, _first(data.get("keys")) if type(data) is dict
                                else None)
            value = super().to_internal_value(data)
            return {**value, "key_batch": checked_batch(value["keys"])}
        return super().to_internal_value(data)


class QueryListField(serializers.ListField):
    """1 to MORPHO_MAX_BATCH queries."""

    default_error_messages = {
        "required": "expected an array of queries, got nothing",
        "null": "expected an array of queries, got null",
    }

    def __init__(self, **kwargs):
        # As KeyListField: for the schema; MORPHO_MAX_BATCH is fixed for a process's life.
        super().__init__(child=PageQuerySerializer(), min_length=1,
                         max_length=settings.MORPHO_MAX_BATCH, **kwargs)

    def to_internal_value(self, data):
        _strict_list(data, "queries", 1, settings.MORPHO_MAX_BATCH)
        return super().to_internal_value(data)


class BatchQuerySerializer(JsonObjectSerializer):
    """A batch: `{"queries": [{"keys": [...]}, ...]}`, answered in order against one epoch; every
    key of one format."""

    queries = QueryListField()

    def to_internal_value(self, data):
        queries = data.get("queries") if type(data) is dict else None
        if type(queries) is list and 1 <= len(queries) <= settings.MORPHO_MAX_BATCH:
            batch = keys_checked_at_once(queries, self.context["domain_bits"],
                                         self.context.get("key_formats", KEY_FORMATS))
            if batch is not None:
                return {"key_batch": batch}
        first = _first(queries)
        note_request_format(self.context, _first(first.get("keys")) if type(first) is dict
                            else None)
        value = super().to_internal_value(data)
        keys = [key for query in value["queries"] for key in query["keys"]]
        return {"key_batch": checked_batch(keys)}


class ServedEpochSerializer(serializers.Serializer):
    """`GET /epoch`: the epoch a party serves and the shape of its page PIR domain."""

    def to_representation(self, epoch) -> dict:
        # The epoch's JSON shape is part of the protocol, so it is defined once, beside the
        # Epoch; what this web server speaks is added here.
        formats = self.context.get("key_formats", KEY_FORMATS)  # the engine's (key_formats_of)
        return {**epoch.describe(), "encodings": list(ENCODINGS),
                "key_formats": [format_name(f) for f in formats]}

"""Serializers of the PIR API: hex DPF keys in, hex pages out, errors naming field and values."""
from __future__ import annotations

import binascii
from typing import Optional

from django.conf import settings
from rest_framework import serializers

from gpu_engine.dpf import DpfKey, KeyBatch, KeyFormatError, key_length
from gpu_engine.protocol import KEYS_PER_QUERY, HexError, parse_hex

# The encodings the query endpoints speak (docs/PROTOCOL.md section 5), advertised in /epoch.
ENCODINGS = ("json", "binary")


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


def key_from_bytes(raw: bytes, domain_bits: int) -> bytes:
    """One key's bytes checked against the server's domain_bits: the one key check of both
    encodings (hex in JSON, raw in binary), a ValidationError coded as the API documents.
    Returns the bytes, which travel on to the engine as they are."""
    expected_len = key_length(domain_bits)
    # The length is checked against the server's domain first, so that a key sized for
    # another domain is reported as such rather than as a bad byte inside it.
    if len(raw) != expected_len and len(raw) >= 19 and raw[18] != domain_bits:
        raise serializers.ValidationError(
            f"domain_bits: expected {domain_bits} (this server's epoch), got {raw[18]} "
            f"(a key of {len(raw)} bytes)",
            code="domain_bits",
        )
    if len(raw) != expected_len:
        raise serializers.ValidationError(
            f"key length: expected {expected_len} bytes (35 + 18 * domain_bits "
            f"{domain_bits}), got {len(raw)}",
            code="key_length",
        )
    try:
        DpfKey.check(raw, expected_domain_bits=domain_bits)
    except KeyFormatError as exc:
        raise serializers.ValidationError(str(exc), code="key_format") from None
    return bytes(raw)


def keys_checked_at_once(queries, domain_bits: int) -> Optional[KeyBatch]:
    """The keys of JSON queries that are all well formed (`{"keys": [3 hex keys]}` each), checked
    in one vectorised pass; None when anything is off, and the caller then validates field by
    field to name every error. It accepts only what the field-by-field check accepts, with the
    same keys: digits with an optional 0x, the length of a key of this domain, and the checks of
    DpfKey.check (KeyBatch.from_bytes makes the same ones for every key at once)."""
    digits = []
    width = 2 * key_length(domain_bits)
    for query in queries:
        keys = query.get("keys") if type(query) is dict else None
        if type(keys) is not list or len(keys) != KEYS_PER_QUERY:
            return None
        for key in keys:
            if type(key) is not str:
                return None
            key = key[2:] if key[:2] in ("0x", "0X") else key
            if len(key) != width:
                return None
            digits.append(key)
    try:
        raw = binascii.unhexlify("".join(digits))  # hex digits only: no spaces, no signs
        return KeyBatch.from_bytes(raw, domain_bits)
    except (ValueError, KeyFormatError):  # binascii.Error is a ValueError
        return None


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
        return key_from_bytes(raw, self.context["domain_bits"])

    def to_representation(self, value) -> str:
        return to_hex(value if isinstance(value, (bytes, bytearray)) else value.to_bytes())


class KeyListField(serializers.ListField):
    """Exactly three keys: the query's three candidate pages."""

    default_error_messages = {
        "required": f"expected an array of {KEYS_PER_QUERY} hex-encoded DPF keys, got nothing",
        "null": f"expected an array of {KEYS_PER_QUERY} hex-encoded DPF keys, got null",
    }

    def __init__(self, **kwargs):
        super().__init__(child=DpfKeyField(), **kwargs)

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


class PageQuerySerializer(JsonObjectSerializer):
    """One query: `{"keys": [k0, k1, k2]}`."""

    keys = KeyListField()

    def to_internal_value(self, data):
        if self.parent is None:  # a request's whole body (in a batch, the batch checks at once)
            batch = keys_checked_at_once([data], self.context["domain_bits"])
            if batch is not None:
                size = len(batch.raw) // KEYS_PER_QUERY
                return {"keys": [batch.raw[i * size:(i + 1) * size] for i in range(KEYS_PER_QUERY)],
                        "key_batch": batch}
        return super().to_internal_value(data)


class QueryListField(serializers.ListField):
    """1 to MORPHO_MAX_BATCH queries."""

    default_error_messages = {
        "required": "expected an array of queries, got nothing",
        "null": "expected an array of queries, got null",
    }

    def __init__(self, **kwargs):
        super().__init__(child=PageQuerySerializer(), **kwargs)

    def to_internal_value(self, data):
        _strict_list(data, "queries", 1, settings.MORPHO_MAX_BATCH)
        return super().to_internal_value(data)


class BatchQuerySerializer(JsonObjectSerializer):
    """A batch: `{"queries": [{"keys": [...]}, ...]}`, answered in order against one epoch."""

    queries = QueryListField()

    def to_internal_value(self, data):
        queries = data.get("queries") if type(data) is dict else None
        if type(queries) is list and 1 <= len(queries) <= settings.MORPHO_MAX_BATCH:
            batch = keys_checked_at_once(queries, self.context["domain_bits"])
            if batch is not None:
                return {"key_batch": batch}
        return super().to_internal_value(data)


class ServedEpochSerializer(serializers.Serializer):
    """`GET /epoch`: the epoch a party serves and the shape of its page PIR domain."""

    def to_representation(self, epoch) -> dict:
        # The epoch's JSON shape is part of the protocol, so it is defined once, beside the
        # Epoch; what this web server speaks is added here.
        return {**epoch.describe(), "encodings": list(ENCODINGS)}

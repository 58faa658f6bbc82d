"""Serializers of bulk jobs: the queries in (JSON list or NDJSON), the job and its progress out."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from django.conf import settings
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from rest_framework import serializers

from morpho_pir.dpf import KEY_FORMAT_V1
from queries import bulk
from queries.api.binary import body_bytes, check_body, parse_query, query_bytes
from queries.api.bulk_parsing import JSONQueryArray, QuerySpool, ndjson_lines
from queries.api.serializers import PageQuerySerializer, json_type
from queries.models import BulkJob, JobStatus

# Invalid queries listed in a 400 at most; reading stops there, so a broken file of 100,000 lines
# neither answers with 100,000 messages nor takes the time to find them.
MAX_LISTED_ERRORS = 1000


class NDJSONSource:
    """The lines of an NDJSON body or uploaded file, parsed one at a time (blank lines skipped)."""

    def __init__(self, fileobj, name: str = "body") -> None:
        self.fileobj = fileobj
        self.name = name

    def __iter__(self) -> Iterator[tuple[int, object]]:
        """(line number from 1, parsed value or a ValueError saying why the line is not JSON)."""
        cap = settings.MORPHO_BULK_MAX_QUERY_BYTES
        for number, raw in ndjson_lines(self.fileobj, cap):
            if raw is None:  # skipped, never held whole
                yield number, ValueError(
                    f"line {number}: expected at most {cap} bytes per line "
                    f"(MORPHO_BULK_MAX_QUERY_BYTES), got more"
                )
                continue
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw)
            except (ValueError, RecursionError) as exc:
                yield (
                    number,
                    ValueError(f"line {number}: expected a JSON object, got invalid JSON ({exc})"),
                )


def _items(data) -> Iterable[tuple[object, object]]:
    if isinstance(data, (NDJSONSource, JSONQueryArray)):
        return iter(data)
    return ((None, item) for item in data)


class BulkQueriesField(serializers.Field):
    """1 to MORPHO_BULK_MAX_QUERIES queries, each validated exactly as one query of a batch.

    Gives the raw bytes of each query's three keys; an invalid query fails the whole job with
    every bad query's index and reason."""

    default_error_messages = {
        "required": "expected an array of queries (JSON) or an NDJSON file of them, got nothing",
        "null": "expected an array of queries, got null",
    }

    def to_internal_value(self, data) -> list[bytes]:
        limit = settings.MORPHO_BULK_MAX_QUERIES
        if not isinstance(data, (list, NDJSONSource, JSONQueryArray)):
            raise serializers.ValidationError(
                f"expected an array of queries, got {json_type(data)}", code="not_a_list"
            )
        if isinstance(data, list) and not 1 <= len(data) <= limit:
            raise serializers.ValidationError(
                f"expected 1 to {limit} queries (MORPHO_BULK_MAX_QUERIES), got {len(data)}",
                code="count",
            )
        # bulk jobs store and run v1 keys (docs/PROTOCOL.md 5.5): v2 keys are refused, each named
        context = {"domain_bits": self.context["domain_bits"], "key_formats": (KEY_FORMAT_V1,)}
        queries = QuerySpool()  # key bytes only, and on disk past a few MiB
        errors: dict = {}
        bad = 0
        index = -1
        for index, (_line, item) in enumerate(_items(data)):
            if index >= limit:
                raise serializers.ValidationError(
                    f"expected 1 to {limit} queries (MORPHO_BULK_MAX_QUERIES), "
                    f"got more than {limit}",
                    code="count",
                )
            if isinstance(item, ValueError):
                detail = {
                    "non_field_errors": [serializers.ErrorDetail(str(item), code="parse_error")]
                }
            else:
                query = PageQuerySerializer(data=item, context=context)
                if query.is_valid():
                    if not bad:  # once a query is bad nothing is stored; keep checking the rest
                        queries.append(b"".join(query.validated_data["keys"]))
                    continue
                detail = query.errors
            bad += 1
            errors[index] = detail
            if bad >= MAX_LISTED_ERRORS:
                break  # the job is refused anyway: reading on would only cost time
        if index < 0:
            raise serializers.ValidationError(
                f"expected 1 to {limit} queries (MORPHO_BULK_MAX_QUERIES), got 0", code="count"
            )
        if bad:
            if bad >= MAX_LISTED_ERRORS:
                errors["more"] = [
                    serializers.ErrorDetail(
                        f"reading stopped at query {index}: {bad} queries are invalid, "
                        f"and the rest were not checked",
                        code="more_errors",
                    )
                ]
            raise serializers.ValidationError(errors)
        return queries


class BulkQueriesFieldSchema(OpenApiSerializerFieldExtension):
    """The schema of BulkQueriesField: 1 to MORPHO_BULK_MAX_QUERIES queries of the batch's shape."""

    target_class = BulkQueriesField

    def map_serializer_field(self, auto_schema, direction):
        query = auto_schema.resolve_serializer(PageQuerySerializer, direction)
        return {"type": "array", "items": query.ref, "minItems": 1,
                "maxItems": settings.MORPHO_BULK_MAX_QUERIES}


class BulkJobCreateSerializer(serializers.Serializer):
    """`POST /bulk/jobs`: `{"queries": [{"keys": [k0, k1, k2]}, ...]}`, or those as NDJSON lines."""

    queries = BulkQueriesField()

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {
                    "non_field_errors": [
                        f'expected a JSON object with "queries", got {json_type(data)}'
                    ]
                },
                code="invalid",
            )
        return super().to_internal_value(data)

    def create(self, validated_data) -> BulkJob:
        queries = validated_data["queries"]
        try:
            return bulk.create_job(
                self.context["owner"],
                queries,
                len(queries),
                self.context["domain_bits"],
                self.context["chunk_size"],
            )
        finally:
            if isinstance(queries, QuerySpool):
                queries.close()


class BulkBinaryJobSerializer(BulkJobCreateSerializer):
    """`POST /bulk/jobs` with an application/octet-stream body: the keys of every query as raw
    bytes, concatenated, 3 per query; each query validated as in the batch endpoint."""

    def to_internal_value(self, data) -> dict:
        raw = memoryview(body_bytes(data))
        domain_bits = self.context["domain_bits"]
        count = check_body(raw, domain_bits, 1, settings.MORPHO_BULK_MAX_QUERIES,
                           limit_setting="MORPHO_BULK_MAX_QUERIES", key_formats=(KEY_FORMAT_V1,))
        size = query_bytes(domain_bits)
        errors: dict = {}
        bad = 0
        for index in range(count):
            _keys, detail = parse_query(raw, index, domain_bits, (KEY_FORMAT_V1,))
            if detail:
                bad += 1
                if len(errors) < MAX_LISTED_ERRORS:
                    errors[index] = {"keys": detail}
        if bad:
            if bad > len(errors):
                errors["more"] = [serializers.ErrorDetail(
                    f"{bad} queries are invalid; the first {len(errors)} are listed",
                    code="more_errors")]
            raise serializers.ValidationError({"queries": errors})
        # Valid keys are stored as sent (a key's bytes are all fields): slices, not copies.
        return {"queries": [raw[index * size:(index + 1) * size] for index in range(count)]}


class BulkJobSerializer(serializers.ModelSerializer):
    """A job as its owner sees it: status, progress, timestamps, epochs, errors, results URL."""

    progress = serializers.SerializerMethodField()
    epoch_ids = serializers.SerializerMethodField()
    chunks = serializers.SerializerMethodField()
    errors = serializers.SerializerMethodField()
    results_url = serializers.SerializerMethodField()

    class Meta:
        model = BulkJob
        fields = [
            "id",
            "status",
            "total",
            "answered",
            "progress",
            "chunk_size",
            "chunks",
            "domain_bits",
            "created",
            "started",
            "finished",
            "epoch_ids",
            "errors",
            "results_url",
        ]
        read_only_fields = fields

    def get_progress(self, job: BulkJob) -> dict:
        # Counted launch by launch, running chunks included; "answered" counts stored answers.
        answered = job.answered_so_far()
        return {"answered": answered, "total": job.total,
                "fraction": round(answered / job.total if job.total else 0.0, 6)}

    def get_epoch_ids(self, job: BulkJob) -> list[int]:
        return job.epoch_ids()

    def get_chunks(self, job: BulkJob) -> dict:
        counts = {status: 0 for status in JobStatus.values}
        for status in job.chunks.values_list("status", flat=True):
            counts[status] += 1
        return counts

    def get_errors(self, job: BulkJob) -> list[dict]:
        errors = (
            [{"chunk": None, "queries": None, "attempts": None, "message": job.error}]
            if job.error
            else []
        )
        for chunk in job.chunks.exclude(error="").only(
            "index", "first", "count", "attempts", "error"
        ):
            errors.append(
                {
                    "chunk": chunk.index,
                    "queries": [chunk.first, chunk.first + chunk.count - 1],
                    "attempts": chunk.attempts,
                    "message": chunk.error,
                }
            )
        return errors

    def get_results_url(self, job: BulkJob) -> str:
        request = self.context.get("request")
        path = f"/bulk/jobs/{job.pk}/results"
        return request.build_absolute_uri(path) if request is not None else path

"""The bulk job API: submit (JSON, NDJSON or binary), read progress, stream results (NDJSON or
binary), cancel."""

from __future__ import annotations

from collections.abc import Iterator

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, mixins, status, viewsets
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.decorators import action
from rest_framework.exceptions import ErrorDetail
from rest_framework.parsers import BaseParser, MultiPartParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from engine.holder import get_engine
from morpho_pir.dpf import KEY_FORMAT_V1
from gpu_engine.engine import key_formats_of
from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES
from queries import bulk
from queries.api.binary import (
    EPOCH_IDS_HEADER,
    EPOCH_RANGES_HEADER,
    OCTET_STREAM,
    QUERIES_HEADER,
    JSONErrorsMixin,
    OctetStreamParser,
    OctetStreamRenderer,
    QualityNegotiation,
    sent_binary,
    wants_binary,
)
from queries.api.bulk_serializers import (
    BulkBinaryJobSerializer,
    BulkJobCreateSerializer,
    BulkJobSerializer,
    NDJSONSource,
)
from queries.api.bulk_limits import BulkSubmitThrottle, check_quota, drain, slots
from queries.api.bulk_parsing import StreamingBulkJSONParser
from queries.api.errors import exception_handler as api_exception_handler
from queries.api.openapi import response_headers
from queries.bulk_runner import bulk_policy
from queries.models import BulkJob, BulkResult

NDJSON = "application/x-ndjson"
ACCEPTED_TYPES = (
    f'application/json, {NDJSON}, multipart/form-data (an NDJSON file in field "file") '
    f"or {OCTET_STREAM}"
)
LINES_PER_WRITE = 16  # result lines joined into one write (about 400 KB)


class NDJSONParser(BaseParser):
    """An NDJSON body: one query object per line, read line by line when validated."""

    media_type = NDJSON

    def parse(self, stream, media_type=None, parser_context=None):
        return {"queries": NDJSONSource(stream, name="body")}


class NDJSONRenderer(JSONRenderer):
    """Lets clients ask for `Accept: application/x-ndjson`; errors still render as one JSON line."""

    media_type = NDJSON
    format = "ndjson"


def stored_chunks(job: BulkJob) -> tuple[list[int], int]:
    """(ids of the job's stored result rows in query order, how many queries they answer)."""
    rows = list(BulkResult.objects.filter(job=job).order_by("index").values_list("pk", "count"))
    return [pk for pk, _ in rows], sum(count for _, count in rows)


def result_lines(chunk_ids: list[int]) -> Iterator[bytes]:
    """The answers of these result rows in query order, one chunk row in memory at a time."""
    size = KEYS_PER_QUERY * PAGE_BYTES
    for pk in chunk_ids:
        first, epoch_id, answers = BulkResult.objects.values_list(
            "first", "epoch_id", "answers"
        ).get(pk=pk)
        answers = bytes(answers)
        lines = []
        for query in range(len(answers) // size):
            base = query * size
            pages = '", "0x'.join(
                answers[base + k * PAGE_BYTES : base + (k + 1) * PAGE_BYTES].hex()
                for k in range(KEYS_PER_QUERY)
            )
            lines.append(
                f'{{"index": {first + query}, "epoch_id": {epoch_id}, "pages": ["0x{pages}"]}}\n'
            )
            if len(lines) == LINES_PER_WRITE:
                yield "".join(lines).encode()
                lines = []
        if lines:
            yield "".join(lines).encode()


def result_bytes(chunk_ids: list[int]) -> Iterator[bytes]:
    """These result rows' answers in query order as raw bytes: each query's three pages."""
    for pk in chunk_ids:
        # A chunk's answers are stored exactly so: query after query, key after key.
        yield bytes(BulkResult.objects.values_list("answers", flat=True).get(pk=pk))


def epoch_ranges(job: BulkJob) -> str:
    """`first-last=epoch_id`, comma-separated: which epoch answered which queries."""
    runs: list[list[int]] = []
    rows = BulkResult.objects.filter(job=job).order_by("index")
    for first, count, epoch_id in rows.values_list("first", "count", "epoch_id"):
        if runs and runs[-1][2] == epoch_id and runs[-1][1] == first - 1:
            runs[-1][1] = first + count - 1
        else:
            runs.append([first, first + count - 1, epoch_id])
    return ",".join(f"{first}-{last}={epoch_id}" for first, last, epoch_id in runs)


class BulkJobViewSet(JSONErrorsMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     viewsets.GenericViewSet):
    """`/bulk/jobs`: a user's jobs. POST submits, GET reads, DELETE cancels, `/results` streams."""

    queryset = BulkJob.objects.all()
    serializer_class = BulkJobSerializer
    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [IsAuthenticated]
    # JSON read as a stream (queries/api/bulk_parsing.py): memory per request stays bounded; a
    # binary body is read whole, bounded by MORPHO_BULK_MAX_BODY_BYTES.
    parser_classes = [StreamingBulkJSONParser, NDJSONParser, MultiPartParser, OctetStreamParser]
    renderer_classes = [JSONRenderer, NDJSONRenderer]
    content_negotiation_class = QualityNegotiation

    def get_queryset(self):
        # Staff see every job (the admin's users); others only their own, so another user's job
        # id answers 404 like an unknown one.
        queryset = super().get_queryset()
        return queryset if self.request.user.is_staff else queryset.filter(owner=self.request.user)

    def get_exception_handler(self):
        def handler(exc, context):
            response = api_exception_handler(exc, context)
            if isinstance(exc, exceptions.UnsupportedMediaType) and response is not None:
                # The API's handler names application/json; this endpoint takes more.
                got = self.request.content_type or "no Content-Type"
                message = f"expected {ACCEPTED_TYPES}, got {got}"
                response.data["detail"] = f"Content-Type: {message}"
                response.data["errors"][0]["message"] = message
            return response

        return handler

    @extend_schema(
        request={
            "application/json": BulkJobCreateSerializer,
            NDJSON: {"type": "string", "description": "one query object per line"},
            "multipart/form-data": {
                "type": "object",
                "properties": {"file": {"type": "string", "format": "binary"}},
            },
            OCTET_STREAM: {
                "type": "string",
                "format": "binary",
                "description": "the DPF keys as raw bytes, concatenated, 3 per query, each "
                "35 + 18 * domain_bits bytes; the length gives the count",
            },
        },
        responses={201: BulkJobSerializer},
    )
    def create(self, request):
        # A user's quota, then one of this process's few reading slots, before the body is read.
        check_quota(request.user)
        with slots.reading():
            return self._create(request)

    def get_throttles(self):
        return [BulkSubmitThrottle()] if self.action == "create" else super().get_throttles()

    def finalize_response(self, request, response, *args, **kwargs):
        if request.method == "POST":
            drain(request)  # refused early (401, 429, 503, a bad query): the client still sends
        return super().finalize_response(request, response, *args, **kwargs)

    def _create(self, request):
        engine = get_engine()
        if KEY_FORMAT_V1 not in key_formats_of(engine):  # bulk jobs store and run v1 keys (5.5)
            # before the body is parsed: none of it could be taken
            raise exceptions.ValidationError({"queries": [ErrorDetail(
                "bulk jobs take v1 keys and this server answers v2 keys only: "
                "send these queries as batch queries with v2 keys",
                code="key_format")]})
        data = request.data
        if isinstance(data, list):  # a bare JSON array of queries
            data = {"queries": data}
        if request.content_type.startswith("multipart/form-data"):
            upload = request.FILES.get("file")
            if upload is None:
                raise exceptions.ValidationError(
                    {"file": ['expected an NDJSON file in the form field "file", got none']}
                )
            data = {"queries": NDJSONSource(upload, name=upload.name)}
        context = {
            "domain_bits": engine.epoch.matrix.domain_bits,
            "owner": request.user,
            "chunk_size": bulk.chunk_size_for(bulk_policy(engine).max_batch),
        }
        create = BulkBinaryJobSerializer if sent_binary(request) else BulkJobCreateSerializer
        serializer = create(data=data, context=context)
        serializer.is_valid(raise_exception=True)
        job = serializer.save()
        body = BulkJobSerializer(job, context={"request": request}).data
        return Response(
            body,
            status=status.HTTP_201_CREATED,
            headers={"Location": request.build_absolute_uri(f"/bulk/jobs/{job.pk}")},
        )

    @extend_schema(
        responses={
            200: BulkJobSerializer,
            409: OpenApiResponse(description="the job is already done, failed or cancelled"),
        }
    )
    def destroy(self, request, pk=None):
        job = self.get_object()
        try:
            job = bulk.cancel_job(job)
        except bulk.JobFinished as exc:
            return Response(
                {"detail": str(exc), "status": exc.job.status}, status=status.HTTP_409_CONFLICT
            )
        return Response(self.get_serializer(job).data)

    @extend_schema(
        responses={
            (200, NDJSON): OpenApiTypes.STR,
            (200, OCTET_STREAM): OpenApiResponse(
                OpenApiTypes.BINARY,
                description=f"With Accept: {OCTET_STREAM}: each query's 3 answers of 4096 bytes "
                f"concatenated in query order; {QUERIES_HEADER} the count, {EPOCH_IDS_HEADER} the "
                f"epochs, {EPOCH_RANGES_HEADER} which queries each answered "
                "(`first-last=epoch_id`, comma-separated).",
            ),
            409: OpenApiResponse(description="the job is still queued or running"),
        }
    )
    @extend_schema(parameters=response_headers(
        (QUERIES_HEADER, int, "Binary results: the number of queries answered."),
        (EPOCH_IDS_HEADER, str, "Binary results: the epochs, comma-separated."),
        (EPOCH_RANGES_HEADER, str, "Binary results: `first-last=epoch_id` per run of queries "
                                   "answered against one epoch, comma-separated."),
    ))
    @action(detail=True, methods=["get"],
            renderer_classes=[JSONRenderer, NDJSONRenderer, OctetStreamRenderer])
    def results(self, request, pk=None):
        """NDJSON, one line per query in order: `{"index", "epoch_id", "pages": [a0, a1, a2]}`;
        with `Accept: application/octet-stream`, the answers as raw bytes in the same order.

        A cancelled or failed job serves the queries it answered (their `index` says which),
        marked `X-Bulk-Partial: true` with their count in `X-Bulk-Answered`."""
        job = self.get_object()
        if job.is_active:
            return Response(
                {
                    "detail": f"job {job.pk} is {job.status} ({job.answered} of {job.total} "
                    "queries answered); results are served once it is done, cancelled or failed",
                    "status": job.status,
                },
                status=status.HTTP_409_CONFLICT,
            )
        # Read once: a chunk that was running at a cancel may still store its answers meanwhile.
        chunk_ids, answered = stored_chunks(job)
        if wants_binary(request):
            response = StreamingHttpResponse(result_bytes(chunk_ids), content_type=OCTET_STREAM)
            response[QUERIES_HEADER] = str(answered)
            response[EPOCH_IDS_HEADER] = ",".join(str(e) for e in job.epoch_ids())
            response[EPOCH_RANGES_HEADER] = epoch_ranges(job)
        else:
            response = StreamingHttpResponse(result_lines(chunk_ids), content_type=NDJSON)
        response["X-Bulk-Total"] = str(job.total)
        response["X-Bulk-Answered"] = str(answered)
        response["X-Bulk-Partial"] = "true" if answered < job.total else "false"
        return response

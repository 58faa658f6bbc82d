"""The bulk job API: submit (JSON or NDJSON), read progress, stream results as NDJSON, cancel."""

from __future__ import annotations

from collections.abc import Iterator

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, mixins, status, viewsets
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.decorators import action
from rest_framework.parsers import BaseParser, MultiPartParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from morphoweb.engine_runtime import get_engine
from queries import bulk
from queries.api.bulk_limits import BulkSubmitThrottle, check_quota, drain, slots
from queries.api.bulk_parsing import StreamingBulkJSONParser
from queries.api.bulk_serializers import BulkJobCreateSerializer, BulkJobSerializer, NDJSONSource
from queries.api.errors import exception_handler as api_exception_handler
from queries.bulk_runner import bulk_policy
from queries.models import KEYS_PER_QUERY, BulkJob, BulkResult, JobStatus

NDJSON = "application/x-ndjson"
ACCEPTED_TYPES = (
    f'application/json, {NDJSON} or multipart/form-data (an NDJSON file in field "file")'
)
PAGE = 4096
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


def result_lines(job: BulkJob) -> Iterator[bytes]:
    """The job's answers in query order, one chunk row in memory at a time."""
    chunk_ids = list(
        BulkResult.objects.filter(job=job).order_by("index").values_list("pk", flat=True)
    )
    size = KEYS_PER_QUERY * PAGE
    for pk in chunk_ids:
        first, epoch_id, answers = BulkResult.objects.values_list(
            "first", "epoch_id", "answers"
        ).get(pk=pk)
        answers = bytes(answers)
        lines = []
        for query in range(len(answers) // size):
            base = query * size
            pages = '", "0x'.join(
                answers[base + k * PAGE : base + (k + 1) * PAGE].hex()
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


class BulkJobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """`/bulk/jobs`: a user's jobs. POST submits, GET reads, DELETE cancels, `/results` streams."""

    queryset = BulkJob.objects.all()
    serializer_class = BulkJobSerializer
    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [IsAuthenticated]
    # JSON read as a stream (queries/api/bulk_parsing.py): memory per request stays bounded.
    parser_classes = [StreamingBulkJSONParser, NDJSONParser, MultiPartParser]
    renderer_classes = [JSONRenderer, NDJSONRenderer]

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
        engine = get_engine()
        context = {
            "domain_bits": engine.epoch.matrix.domain_bits,
            "owner": request.user,
            "chunk_size": bulk.chunk_size_for(bulk_policy(engine).max_batch),
        }
        serializer = BulkJobCreateSerializer(data=data, context=context)
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
            409: OpenApiResponse(description="the job is not done yet"),
        }
    )
    @action(detail=True, methods=["get"])
    def results(self, request, pk=None):
        """NDJSON, one line per query in order: `{"index", "epoch_id", "pages": [a0, a1, a2]}`."""
        job = self.get_object()
        if job.status != JobStatus.DONE:
            return Response(
                {
                    "detail": f"job {job.pk} is {job.status} ({job.answered} of {job.total} "
                    "queries answered); results are served once it is done",
                    "status": job.status,
                },
                status=status.HTTP_409_CONFLICT,
            )
        response = StreamingHttpResponse(result_lines(job), content_type=NDJSON)
        response["X-Bulk-Total"] = str(job.total)
        return response

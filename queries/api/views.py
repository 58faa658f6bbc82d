"""Views of the PIR API: validate with a serializer, hand the queries to the engine, answer."""
from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout

from django.conf import settings
from rest_framework import status
from rest_framework.exceptions import APIException
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from drf_spectacular.utils import extend_schema

from engine.holder import get_engine
from gpu_engine.engine import EngineUnavailable, key_formats_of
from gpu_engine.interface import QueryEngine
from morpho_pir.http import RECORDS_HEADER
from morpho_pir.protocol import query_key_counts
from queries.api.binary import (
    BinaryBatchQuerySerializer,
    JSONErrorsMixin,
    BinaryPageQuerySerializer,
    OctetStreamParser,
    OctetStreamRenderer,
    QualityNegotiation,
    answered_queries,
    binary_answer,
    sent_binary,
    state_headers,
    wants_binary,
)
from queries.api.answers import AnswerBody, AnswerJSONRenderer
from queries.api.openapi import (
    BATCH_REQUEST,
    BATCH_RESPONSE,
    EPOCH_RESPONSE,
    PAGE_REQUEST,
    PAGE_RESPONSE,
    binary_answer_headers,
)
from queries.api.parsers import StrictJSONParser
from queries.api.serializers import (
    BatchQuerySerializer,
    ServedEpochSerializer,
    PageQuerySerializer,
)
from queries.metrics import observe_query

log = logging.getLogger(__name__)


class PublicAPIView(APIView):
    # PIR queries are anonymous by design: no session, no CSRF token, no user lookup.
    authentication_classes: list = []
    permission_classes = [AllowAny]

    def validated(self, request):
        """(engine, the epoch the keys were checked against, validated data) or a 400; a 503
        first where the engine is held (its epoch is not the party's: keys are not judged by it)."""
        engine = serving_engine()
        epoch = engine.epoch
        check_records_fingerprint(request, epoch)
        serializer = self.serializer_class_for(request)(
            data=request.data, context={"domain_bits": epoch.matrix.domain_bits,
                                        "key_formats": key_formats_of(engine)}
        )
        serializer.is_valid(raise_exception=True)
        return engine, epoch, serializer.validated_data

    def serializer_class_for(self, request):
        """The serializer of this request's body (QueryAPIView picks one by Content-Type)."""
        return self.serializer_class


class RecordsMismatch(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "records_fingerprint"


def check_records_fingerprint(request, epoch) -> None:
    """A lookup names the records table its keys were made for (docs/PROTOCOL.md section 9.4);
    a party whose epoch has another (or none) refuses it rather than answer other pages."""
    given = request.headers.get(RECORDS_HEADER)
    if given is None:
        return
    served = epoch.records.fingerprint_hex if epoch.records is not None else None
    if served is not None and given.strip().lower() == served:
        return
    expected = (f"{served}, the records table of epoch {epoch.epoch_id}" if served else
                f"no fingerprint: epoch {epoch.epoch_id} holds no records table")
    message = (f"expected {expected}, got {given[:80]!r}; read GET /epoch again and make the keys "
               f"for its records table")
    raise RecordsMismatch({"detail": f"{RECORDS_HEADER}: {message}", "errors": [
        {"field": RECORDS_HEADER, "query": None, "key": None, "code": "records_fingerprint",
         "message": message}]})


def serving_engine() -> QueryEngine:
    """This process's engine, or 503 where it is held: it cannot serve its party's active epoch
    and answers no query, so neither its epoch nor a judgement of keys by it would be true."""
    engine = get_engine()
    held = engine.held  # read once: a RemoteEngine's changes with each PONG
    if held:
        raise EngineUnavailable(held, retry_after=5)
    return engine


def answer(engine: QueryEngine, epoch, data):
    """Submit a validated request's keys (the serializers' one KeyBatch, which the engine takes
    as checked) and wait: the answer, or 503 when it cannot come in time."""
    timeout = settings.MORPHO_QUERY_TIMEOUT
    keys = data["key_batch"]
    try:
        return engine.submit_keys(keys, query_key_counts(len(keys))).result(timeout=timeout)
    except ValueError as exc:
        # The keys were validated against `epoch`; the engine (here or in the engine server)
        # refuses them only if it switched to an epoch of another domain since, which a
        # RemoteEngine may not know yet (its epoch comes with the engine server's answers). The
        # client re-reads /epoch and retries.
        if engine.epoch.epoch_id == epoch.epoch_id:
            log.warning("the engine refused keys checked against its epoch %s: %s",
                        epoch.epoch_id, exc)
        raise EngineUnavailable("the epoch changed while the request was validated", 1) from None
    except FutureTimeout:
        # Not cancelled: the engine resolves every future it dequeued, and the answer is
        # simply dropped when it comes.
        raise EngineUnavailable(f"no answer from the engine within {timeout:g} s", timeout) from None


class EpochView(PublicAPIView):
    """`GET /epoch`: what a client needs to make keys for this party."""

    serializer_class = ServedEpochSerializer

    @extend_schema(responses=EPOCH_RESPONSE)
    def get(self, request):
        engine = serving_engine()
        # the served state beside the epoch: a client compares it between the two parties
        epoch = self.serializer_class(engine.epoch, context={"key_formats": key_formats_of(engine)})
        return Response({**epoch.data, "state": engine.state.describe()})


class QueryAPIView(JSONErrorsMixin, PublicAPIView):
    """A query endpoint: JSON (hex) or binary bodies in, JSON or binary answers out."""

    parser_classes = [StrictJSONParser, OctetStreamParser]
    renderer_classes = [AnswerJSONRenderer, OctetStreamRenderer]  # JSON unless Accept asks for binary
    content_negotiation_class = QualityNegotiation
    accepted_content_types = "application/json or application/octet-stream"
    binary_serializer_class: type

    def serializer_class_for(self, request):
        return self.binary_serializer_class if sent_binary(request) else self.serializer_class


class PageQueryView(QueryAPIView):
    """`POST /query/page/gpu`: one query of three keys, three 4096-byte answers."""

    serializer_class = PageQuerySerializer
    binary_serializer_class = BinaryPageQuerySerializer
    single_query = True  # errors name query 0

    @extend_schema(request=PAGE_REQUEST, responses=PAGE_RESPONSE,
                   parameters=binary_answer_headers())
    @observe_query("/query/page/gpu")
    def post(self, request):
        engine, epoch, data = self.validated(request)
        result = answer(engine, epoch, data)
        if wants_binary(request):
            return binary_answer(result)
        return Response(AnswerBody(result, single=True), headers=state_headers(result.state))


class BatchPageQueryView(QueryAPIView):
    """`POST /query/page/gpu/batch`: 1..MORPHO_MAX_BATCH queries answered in order, one epoch."""

    serializer_class = BatchQuerySerializer
    binary_serializer_class = BinaryBatchQuerySerializer

    @extend_schema(request=BATCH_REQUEST, responses=BATCH_RESPONSE,
                   parameters=binary_answer_headers())
    @observe_query("/query/page/gpu/batch", queries=answered_queries)
    def post(self, request):
        engine, epoch, data = self.validated(request)
        result = answer(engine, epoch, data)
        if wants_binary(request):
            return binary_answer(result)
        return Response(AnswerBody(result, single=False), headers=state_headers(result.state))

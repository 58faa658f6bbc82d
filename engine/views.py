"""`GET /health`: this process's engine (here, or the engine server it submits to) as it is now."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.config import engine_settings
from engine.errors import EngineStartFailed, unavailable
from engine.holder import get_engine

HEALTH_RESPONSE = inline_serializer("Health", {
    "status": serializers.CharField(help_text='"ok"; with a 503 "warming", "held" (running, but '
                                              'the active epoch cannot be served: "failure" says '
                                              'why) or "unavailable"'),
    "epoch_id": serializers.IntegerField(),
    "block_number": serializers.IntegerField(),
    "num_pages": serializers.IntegerField(),
    "domain_bits": serializers.IntegerField(),
})


class HealthView(APIView):
    """`GET /health`: 200 with the epoch, backend and queue depth; 503 when the engine is down."""

    # Anonymous, like the PIR queries: no session, no CSRF token, no user lookup.
    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(responses=HEALTH_RESPONSE)
    def get(self, request):
        try:
            engine = get_engine()
        except EngineStartFailed as exc:
            response = unavailable(exc.reason, exc.retry_after)
            response.data = {"status": "unavailable", "detail": exc.reason}
            return response
        health = engine.health()
        # The protocol's fields first, then everything the engine reports (backend, fallback
        # reason, queue depth per lane, resident bytes, device memory; with an engine server
        # also its address, whether it is reachable, and whether it is still warming up).
        if health.get("warming"):
            status = "warming"
        elif health.get("held"):
            status = "held"  # up, answering no query: the party's active epoch cannot be served
        else:
            status = "ok" if health.get("running", True) else "unavailable"
        body = {"status": status}
        if health.get("reachable", True):
            epoch = engine.epoch
            body.update(epoch_id=epoch.epoch_id, block_number=epoch.block_number,
                        num_pages=epoch.matrix.num_pages, domain_bits=epoch.matrix.domain_bits)
        body.update({key: value for key, value in health.items() if key not in body})
        if status != "ok":
            reason = health.get("failure") or f"engine is {status}"
            response = unavailable(reason, engine_settings().retry_after_s)
            response.data = body
            return response
        return Response(body)


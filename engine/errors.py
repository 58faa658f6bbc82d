"""Engine refusals as the API answers them: 503 with the reason and a Retry-After header.

Every refusal is a gpu_engine EngineBusy (reason, retry_after): the engine's own (overloaded,
unavailable), a start that failed here, and the web side's (no answer in time, the epoch changed
under a request).
"""
from __future__ import annotations

import math

from rest_framework import status
from rest_framework.response import Response

from gpu_engine.engine import EngineUnavailable


class EngineStartFailed(EngineUnavailable):
    """The engine could not be built (no matrix, backend unavailable); the API answers 503."""


def retry_after_header(seconds: float) -> str:
    # Retry-After takes whole seconds; never tell a client to retry at once.
    return str(max(1, math.ceil(seconds or 1)))


def unavailable(reason: str, retry_after: float) -> Response:
    """The 503 of a refusal: {"detail": reason} and Retry-After."""
    return Response(
        {"detail": reason},
        status=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": retry_after_header(retry_after)},
    )

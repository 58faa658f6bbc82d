"""Request middleware: refuse a body over its path's size limit with 413 before it is read."""
from __future__ import annotations

from django.conf import settings
from django.http import JsonResponse


BULK_PREFIX = "/bulk/"  # bulk job submissions carry up to MORPHO_BULK_MAX_QUERIES queries


def body_limit(path: str) -> tuple[int, str]:
    """(largest body in bytes, the setting that says so) for a request path."""
    if path.startswith(BULK_PREFIX):
        return settings.MORPHO_BULK_MAX_BODY_BYTES, "MORPHO_BULK_MAX_BODY_BYTES"
    return settings.MORPHO_MAX_BODY_BYTES, "MORPHO_MAX_BODY_BYTES"


class BodySizeLimitMiddleware:
    """Answers 413 from the declared length alone; 400 for a malformed length, 411 for none."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.META.get("CONTENT_LENGTH") and "chunked" in request.META.get(
            "HTTP_TRANSFER_ENCODING", ""
        ).lower():
            # WSGI gives Django no length for a chunked body, and Django then reads it as empty:
            # say so instead of reporting the fields of an empty document as missing.
            message = "expected a Content-Length header, got a chunked body"
            return JsonResponse(
                {"detail": f"Content-Length: {message}",
                 "errors": [{"field": "Content-Length", "message": message}]},
                status=411,
            )
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
            if length < 0:
                raise ValueError(raw)
        except ValueError:
            message = f"expected a non-negative integer, got {raw!r}"
            return JsonResponse(
                {"detail": f"Content-Length: {message}",
                 "errors": [{"field": "Content-Length", "message": message}]},
                status=400,
            )
        limit, setting = body_limit(request.path)
        if length > limit:
            message = f"expected at most {limit} bytes ({setting}), got {length}"
            return JsonResponse(
                {"detail": f"body: {message}", "errors": [{"field": "body", "message": message}]},
                status=413,
            )
        return self.get_response(request)

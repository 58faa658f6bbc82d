"""Error responses: field-keyed 400s, 503 + Retry-After for refusals, JSON 400/403/404/500."""
from __future__ import annotations

from typing import Any, Iterator, Optional

from django.core.exceptions import DisallowedHost, RequestDataTooBig
from django.http import JsonResponse
from rest_framework import exceptions
from rest_framework.views import exception_handler as drf_exception_handler

from engine.errors import unavailable
from gpu_engine.engine import EngineBusy


def _walk(detail: Any, path: list) -> Iterator[tuple[list, Any]]:
    # DRF nests errors as dicts (field name or list index -> errors) and lists (per item, or
    # the messages of one field); the leaves are ErrorDetail strings.
    if isinstance(detail, dict):
        for key, value in detail.items():
            yield from _walk(value, path + [key])
    elif isinstance(detail, list):
        if all(isinstance(item, str) for item in detail):
            for item in detail:
                yield path, item
        else:
            for index, value in enumerate(detail):
                if value:  # ListSerializer puts {} at items that were valid
                    yield from _walk(value, path + [index])
    else:
        yield path, detail


def _index_after(path: list, name: str) -> Optional[int]:
    for position, part in enumerate(path[:-1]):
        if part == name and isinstance(path[position + 1], (int, str)):
            try:
                return int(path[position + 1])
            except ValueError:
                return None
    return None


def flatten_errors(detail: Any, single_query: bool = False) -> list[dict]:
    """One entry per error: the field path, its query and key index, the code and the message."""
    errors = []
    for path, message in _walk(detail, []):
        path = [part for part in path if part != "non_field_errors"]
        field = ""
        for part in path:
            if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
                field += f"[{part}]"
            else:
                field += f".{part}" if field else str(part)
        query = _index_after(path, "queries")
        if query is None and single_query and path[:1] == ["keys"]:
            query = 0
        errors.append(
            {
                "field": field or "body",
                "query": query,
                "key": _index_after(path, "keys"),
                "code": getattr(message, "code", "invalid"),
                "message": str(message),
            }
        )
    return errors


def exception_handler(exc, context):
    """DRF exception handler: every error response is JSON that says what was wrong."""
    if isinstance(exc, EngineBusy):  # the engine's refusals, a failed start, no answer in time
        return unavailable(exc.reason, exc.retry_after)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # not an API error: a bug, and Django's 500 handler answers it
    if isinstance(exc, exceptions.ValidationError):
        view = context.get("view")
        errors = flatten_errors(exc.detail, getattr(view, "single_query", False))
        first = errors[0] if errors else {"field": "body", "message": "invalid request"}
        response.data = {"detail": f"{first['field']}: {first['message']}", "errors": errors}
    elif isinstance(exc, exceptions.ParseError):
        message = f"expected a JSON document, got: {exc.detail}"
        response.data = {
            "detail": f"body: {message}",
            "errors": [{"field": "body", "query": None, "key": None, "code": "parse_error",
                        "message": message}],
        }
    elif isinstance(exc, exceptions.UnsupportedMediaType):
        request = context.get("request")
        got = request.content_type if request is not None else ""
        expected = getattr(context.get("view"), "accepted_content_types", "application/json")
        message = f"expected {expected}, got {got or 'no Content-Type'}"
        response.data = {
            "detail": f"Content-Type: {message}",
            "errors": [{"field": "Content-Type", "query": None, "key": None,
                        "code": "unsupported_media_type", "message": message}],
        }
    return response


def not_found(request, exception=None):
    """handler404: unknown paths answer JSON, like the API."""
    return JsonResponse({"detail": f"no endpoint at {request.path}"}, status=404)


def server_error(request):
    """handler500: a bug; the body says so without a traceback."""
    return JsonResponse({"detail": "internal server error"}, status=500)


def bad_request(request, exception=None):
    """handler400: Django's own 400s (a Host not in ALLOWED_HOSTS, an oversized form) as JSON."""
    if isinstance(exception, DisallowedHost):
        host = request.META.get("HTTP_HOST") or request.META.get("SERVER_NAME", "")
        message = (f"expected a host name this server answers for (ALLOWED_HOSTS), "
                   f"got {host[:200]!r}")
        return JsonResponse({"detail": f"Host: {message}",
                             "errors": [{"field": "Host", "message": message}]}, status=400)
    if isinstance(exception, RequestDataTooBig):
        message = "expected a smaller form body (DATA_UPLOAD_MAX_MEMORY_SIZE)"
        return JsonResponse({"detail": f"body: {message}",
                             "errors": [{"field": "body", "message": message}]}, status=400)
    return JsonResponse({"detail": "bad request"}, status=400)


def permission_denied(request, exception=None):
    """handler403: outside the API (whose 403s DRF writes), still JSON."""
    return JsonResponse({"detail": "permission denied"}, status=403)


def csrf_failure(request, reason=""):
    """CSRF_FAILURE_VIEW: a form post without a valid CSRF token (the admin's, the dashboard's)."""
    return JsonResponse({"detail": f"CSRF verification failed: {reason}"}, status=403)

"""Request middleware: refuse a body over its path's size limit with 413 before it is read, and
serve a path with or without its trailing slash."""
from __future__ import annotations

import functools

from django.conf import settings
from django.http import JsonResponse
from django.urls import is_valid_path

from engine.json_errors import header_error


BULK_PREFIX = "/bulk/"  # bulk job submissions carry up to MORPHO_BULK_MAX_QUERIES queries
# HTML pages keep Django's redirect to the slashed path, so the browser shows the canonical URL.
REDIRECTED_PREFIXES = ("/admin",)
RESOLVED_PATHS_KEPT = 1024  # paths whose resolvability each process remembers (a bounded LRU)


def body_limit(path: str) -> tuple[int, str]:
    """(largest body in bytes, the setting that says so) for a request path."""
    if path.startswith(BULK_PREFIX):
        return settings.MORPHO_BULK_MAX_BODY_BYTES, "MORPHO_BULK_MAX_BODY_BYTES"
    return settings.MORPHO_MAX_BODY_BYTES, "MORPHO_MAX_BODY_BYTES"


def length_required() -> JsonResponse:
    """411 for a chunked body (the front end of `make run` answers it alike)."""
    return header_error(411, "Content-Length", "length_required",
                        "expected a Content-Length header, got a chunked body")


def declared_length_error(path: str, raw: str) -> JsonResponse | None:
    """400 for a malformed Content-Length, 413 for one over the path's limit, else None."""
    try:
        length = int(raw)
        if length < 0:
            raise ValueError(raw)
    except ValueError:
        return header_error(400, "Content-Length", "content_length",
                            f"expected a non-negative integer, got {raw!r}")
    limit, setting = body_limit(path)
    if length > limit:
        return header_error(413, "body", "too_large",
                            f"expected at most {limit} bytes ({setting}), got {length}")
    return None


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
            return length_required()
        error = declared_length_error(request.path, request.META.get("CONTENT_LENGTH") or "0")
        return error or self.get_response(request)


class OptionalSlashMiddleware:
    """`/bulk/jobs/` is `/bulk/jobs` and `/api/epochs` is `/api/epochs/`: a path that resolves
    only in its other form is served as that form, for every method (a redirect would turn a
    POST into a GET in most clients). Admin pages keep Django's APPEND_SLASH redirect."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        path = request.path_info
        if path != "/" and not path.startswith(REDIRECTED_PREFIXES):
            urlconf = getattr(request, "urlconf", None) or settings.ROOT_URLCONF
            if not resolves(path, urlconf):
                other = path[:-1] if path.endswith("/") else path + "/"
                if resolves(other, urlconf):
                    request.path = request.path[: len(request.path) - len(path)] + other
                    request.path_info = other
        return self.get_response(request)


@functools.lru_cache(maxsize=RESOLVED_PATHS_KEPT)
def resolves(path: str, urlconf: str) -> bool:
    """Whether `path` names a view of `urlconf`, remembered: the URL patterns do not change while
    a process runs, and Django resolves the path again to dispatch the request anyway."""
    return bool(is_valid_path(path, urlconf))

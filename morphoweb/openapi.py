"""OpenAPI (drf-spectacular) additions of the project: the error responses every operation can
give, with their JSON body (the query endpoints' own bodies: queries/api/openapi.py), and
/api/schema served from bytes built once per process."""
from __future__ import annotations

import logging
import threading
import time

from django.http import HttpResponse
from drf_spectacular.views import SpectacularAPIView

from queries.api.binary import OCTET_STREAM

log = logging.getLogger(__name__)

ERROR_SCHEMA = {
    "type": "object",
    "description": "What was wrong: `detail` in words; for invalid input, `errors` names each field.",
    "properties": {
        "detail": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object"}},
    },
    "required": ["detail"],
}
ERRORS = {
    "400": "Malformed request: the body says which field, query or key, expected vs got.",
    "401": "Not signed in (a DRF token or an admin session is needed).",
    "403": "Signed in without the permission this operation needs.",
    "404": "No such object, or no endpoint at this path.",
    "413": "Body over MORPHO_MAX_BODY_BYTES (MORPHO_BULK_MAX_BODY_BYTES under /bulk/).",
    "415": "Body not of a media type the operation accepts (application/json; the query endpoints "
           "and bulk jobs also application/octet-stream).",
    "429": "Too many requests from this client address (MORPHO_QUERY_THROTTLE), or bulk jobs from "
           "this user (MORPHO_BULK_SUBMIT_THROTTLE, MORPHO_BULK_MAX_ACTIVE_JOBS); see Retry-After.",
    "503": "Cannot answer now (epoch switching, engine down, overloaded); see Retry-After.",
}


def document_errors(result, generator, request, public):
    """Postprocessing hook: add the error responses each operation can give, with their body."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    error = {"schema": {"$ref": "#/components/schemas/Error"}}
    for path, path_item in result.get("paths", {}).items():
        # An error is rendered in whichever media type the client asked for (JSON, NDJSON), but
        # as JSON when binary was asked for; an operation without a body (a 204) still renders
        # its errors like its siblings.
        types = {media for operation in path_item.values()
                 for response in operation.get("responses", {}).values()
                 for media in response.get("content", {})} - {OCTET_STREAM} | {"application/json"}
        body = {media: error for media in sorted(types)}
        for method, operation in path_item.items():
            signed_in = any(requirement for requirement in operation.get("security", [{}]))
            codes = ["400", "404"]
            codes += ["401", "403"] if signed_in else ["429", "503"]
            if method in ("post", "put", "patch"):
                codes += ["413", "415"]
            if signed_in and method == "post" and path.startswith("/bulk/"):
                codes += ["429", "503"]  # queries/api/bulk_limits.py: rate, quota, reading slots
            responses = operation.setdefault("responses", {})
            for code in codes:
                responses.setdefault(code, {"description": ERRORS[code], "content": body})
    return result


class SchemaView(SpectacularAPIView):
    """`GET /api/schema`: the schema of the whole API, in YAML or JSON as negotiated.

    Building it walks every view (about 0.15 s of CPU), and drf-spectacular's generator is not
    safe in two threads at once (its lazy class loading answered 500s under concurrent
    requests). So each process builds it once, under a lock (at start: morphoweb/wsgi.py), and
    serves the same bytes to every request, counted by the anonymous request rate like the
    other public endpoints.
    """

    _lock = threading.Lock()
    _schema: dict | None = None
    _rendered: dict = {}  # renderer class -> bytes

    @classmethod
    def build(cls) -> dict:
        """The schema, generated on the first call in this process only."""
        with cls._lock:
            if cls._schema is None:
                started = time.monotonic()
                generator = cls.generator_class(urlconf=cls.urlconf, patterns=cls.patterns)
                cls._schema = generator.get_schema(request=None, public=cls.serve_public)
                log.info("built the OpenAPI schema in %.2f s", time.monotonic() - started)
            return cls._schema

    @classmethod
    def prebuild(cls) -> None:
        """Build the schema and render it in every format now, before requests arrive."""
        for renderer_class in cls.renderer_classes:
            cls._bytes(renderer_class)

    @classmethod
    def _bytes(cls, renderer_class) -> bytes:
        rendered = cls._rendered.get(renderer_class)
        if rendered is None:
            schema = cls.build()
            rendered = renderer_class().render(schema, renderer_class.media_type, {})
            with cls._lock:
                rendered = cls._rendered.setdefault(renderer_class, rendered)
        return rendered

    def _get_schema_response(self, request):
        renderer = request.accepted_renderer
        response = HttpResponse(self._bytes(type(renderer)),
                                content_type=request.accepted_media_type)
        response["Content-Disposition"] = (
            f'inline; filename="{self._get_filename(request, None)}"')
        return response

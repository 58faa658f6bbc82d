"""OpenAPI (drf-spectacular) additions of the project: the error responses every operation can
give, with their JSON body (the query endpoints' own bodies: queries/api/openapi.py)."""
from __future__ import annotations

from queries.api.binary import OCTET_STREAM

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

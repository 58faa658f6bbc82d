"""An error about a request as a whole (a header, a query parameter), in the JSON shape of the
API's other errors. Django only: the front end of `make run` answers with it too."""
from __future__ import annotations

from django.http import JsonResponse


def header_error(status: int, field: str, code: str, message: str) -> JsonResponse:
    """An error about the request as a whole, in the shape of the API's other errors."""
    error = {"field": field, "query": None, "key": None, "code": code, "message": message}
    return JsonResponse({"detail": f"{field}: {message}", "errors": [error]}, status=status)

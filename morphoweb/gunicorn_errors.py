"""gunicorn's own error responses (malformed request line or headers, ...) as JSON, like the API's.

gunicorn answers a request it cannot parse itself, before Django sees it, from
`Worker.handle_error`, which ends in `gunicorn.util.write_error(sock, status, reason, message)`:
an HTML page. gunicorn has no setting or server hook for that body (its hooks see requests
that parsed, not these), so a custom worker class would have to copy handle_error whole. Instead
`install()` replaces that one writer, with the same signature, in the process that runs the
application: every status and message gunicorn chose stays as it was, only the body is JSON.
"""
from __future__ import annotations

import json
import sys


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn.util.write_error, with `{"detail": "<reason>: <message>"}` as the body."""
    from gunicorn import util  # only ever called from inside gunicorn

    detail = f"{reason}: {mesg}" if mesg else reason
    body = json.dumps({"detail": detail}).encode("ascii")  # ASCII: headers are latin-1 anyway
    head = (
        f"HTTP/1.1 {int(status_int)} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    ).encode("latin-1")
    util.write_nonblock(sock, head + body)


def install() -> bool:
    """Make this process's gunicorn write its error responses as JSON; False outside gunicorn."""
    if "gunicorn" not in sys.modules:
        return False  # runserver, Celery, tests: gunicorn is not answering here
    from gunicorn import util

    util.write_error = write_json_error
    return True

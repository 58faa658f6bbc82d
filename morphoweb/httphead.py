"""Request heads at the front end of `make run` (morphoweb/frontend.py): parsed, checked against
gunicorn's limits and the service's body limits, and refused with JSON in the API's shape."""
from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Optional

from engine.json_errors import header_error
from morphoweb.middleware import declared_length_error, length_required
from morphoweb.spool import Spool

# gunicorn's own limits (limit_request_line, limit_request_field_size, limit_request_fields):
# refused here first, in JSON, since gunicorn's refusals are plain text.
MAX_REQUEST_LINE_BYTES = 4094  # without its CRLF
MAX_FIELD_BYTES = 8188  # a header line without its CRLF (gunicorn's 8190 counts it)
MAX_FIELDS = 100
# The front end writes four headers of its own (X-Forwarded-For, X-Forwarded-Proto,
# Content-Length, Connection) in place of any the client sent: a client's head that gunicorn would
# refuse once they are added is refused here.
MAX_CLIENT_FIELDS = MAX_FIELDS - 4
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
TARGET = re.compile(rb"[\x21-\x7e]+")


class Refusal(Exception):
    """A request answered by the front end itself, after which the connection is closed."""

    def __init__(self, response, headers: Optional[dict] = None) -> None:
        super().__init__(response.status_code)
        self.response, self.headers = response, headers or {}


def refuse(status: int, field: str, code: str, message: str, headers=None) -> Refusal:
    """A Refusal whose body has the shape of the API's errors (morphoweb.middleware)."""
    return Refusal(header_error(status, field, code, message), headers)


@dataclass
class Request:
    method: bytes
    target: bytes
    version: bytes
    headers: list[tuple[str, bytes, bytes]]  # (lower-case name, name, value)
    length: Optional[int]  # the declared Content-Length; None without one
    body: Spool

    def values(self, name: str) -> list[bytes]:
        return [value for lower, _, value in self.headers if lower == name]

    def wants_keepalive(self) -> bool:
        tokens = {t.strip().lower() for v in self.values("connection") for t in v.split(b",")}
        if self.version == b"HTTP/1.1":
            return b"close" not in tokens
        return b"keep-alive" in tokens


def _text(raw: bytes) -> str:
    return raw[:100].decode("latin-1").rstrip("\r\n")


def parse_head(lines: list[bytes]) -> tuple[bytes, bytes, bytes, list]:
    """(method, target, version, headers) of a request head; Refusal 400 or 505 if malformed."""
    parts = lines[0].rstrip(b"\r\n").split(b" ")
    if len(parts) != 3 or not TOKEN.fullmatch(parts[0]) or not TARGET.fullmatch(parts[1]):
        raise refuse(400, "request line", "malformed",
                     f"expected METHOD TARGET HTTP/1.1, got {_text(lines[0])!r}")
    method, target, version = parts
    if version not in (b"HTTP/1.0", b"HTTP/1.1"):
        raise refuse(505, "request line", "http_version",
                     f"expected HTTP/1.0 or HTTP/1.1, got {_text(version)!r}")
    headers = []
    for line in lines[1:]:
        line = line.rstrip(b"\r\n")
        name, colon, value = line.partition(b":")
        # No folded lines, no space before the colon, no bare CR: each is a way to make two
        # parsers disagree on where a header (or the request) ends.
        if not colon or not TOKEN.fullmatch(name) or b"\r" in value or b"\0" in value:
            raise refuse(400, "headers", "malformed", f"expected Name: value, got {_text(line)!r}")
        headers.append((name.decode("latin-1").lower(), name, value.strip(b" \t")))
    return method, target, version, headers


def check_line(line: Optional[bytes], index: int) -> None:
    """Refusal 414 or 431 for line `index` of a head (0: the request line) past gunicorn's
    limits; None for a line longer than the front end reads (MAX_FIELD_BYTES)."""
    size = MAX_FIELD_BYTES + 1 if line is None else len(line.rstrip(b"\r\n"))
    got = f"more than {MAX_FIELD_BYTES}" if line is None else str(size)
    if index == 0 and size > MAX_REQUEST_LINE_BYTES:
        raise refuse(414, "request line", "uri_too_long",
                     f"expected at most {MAX_REQUEST_LINE_BYTES} bytes, got {got}")
    if index > 0 and size > MAX_FIELD_BYTES:
        raise refuse(431, "headers", "headers_too_large",
                     f"expected at most {MAX_FIELD_BYTES} bytes a header, got {got}")
    if index > MAX_CLIENT_FIELDS:
        raise refuse(431, "headers", "headers_too_large",
                     f"expected at most {MAX_CLIENT_FIELDS} headers")


def declared_length(path: str, headers: list) -> Optional[int]:
    """The body's length from Content-Length; Refusal 411 for a chunked one, 400 or 413."""
    if any(lower == "transfer-encoding" for lower, _, _ in headers):
        raise Refusal(length_required())
    values = {v.strip() for lower, _, value in headers if lower == "content-length"
              for v in value.split(b",")}
    if not values:
        return None
    raw = b", ".join(sorted(values)).decode("latin-1")  # several different ones: a 400
    error = declared_length_error(path, raw)
    if error is not None:
        raise Refusal(error)
    return int(raw)


def refusal_bytes(refusal: Refusal) -> bytes:
    """The whole HTTP answer of a refusal, which closes the connection."""
    response = refusal.response
    head = [f"HTTP/1.1 {response.status_code} {HTTPStatus(response.status_code).phrase}",
            "Content-Type: application/json", f"Content-Length: {len(response.content)}",
            *(f"{name}: {value}" for name, value in refusal.headers.items()),
            "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + response.content

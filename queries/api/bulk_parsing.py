"""Bulk bodies read as streams: bounded memory per request, whatever the body holds.

Parsed whole, 64 MiB of `[[],[],...]` would become 22 million Python lists (1.2 GB, 11-15 s
holding the GIL, every other request stalled). So a JSON body is read
64 KiB at a time, and each query, one array element of at most MORPHO_BULK_MAX_QUERY_BYTES, is
decoded on its own; NDJSON lines have the same cap; validated queries are kept as key bytes in a
spool that moves to a temporary file past SPOOL_MEMORY_BYTES.
"""
from __future__ import annotations

import codecs
import json
import re
import tempfile
from collections.abc import Iterator

from django.conf import settings
from rest_framework import exceptions
from rest_framework.parsers import BaseParser

READ_BYTES = 64 * 1024  # read from the body at a time
SPOOL_MEMORY_BYTES = 4 << 20  # validated key bytes kept in memory before spilling to a file
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Incomplete(Exception):
    """The value runs past what has been read so far."""


_AFTER_VALUE = frozenset(" \t\n\r,]}:")


def _may_continue(exc: json.JSONDecodeError, read: int) -> bool:
    """Whether a decode error may only mean the value goes on past what was read: it stopped at
    the end of the text, or in a string that has not closed yet."""
    return exc.pos >= read - 6 or exc.msg.startswith("Unterminated string")


class JSONStream:
    """Reads JSON values one at a time from a byte stream, holding at most `cap` chars of one."""

    def __init__(self, stream, cap: int) -> None:
        self.stream = stream
        self.cap = cap
        self.buf = ""
        self.pos = 0
        self.eof = stream is None
        self.offset = 0  # characters consumed before buf[0], for messages
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def _fill(self) -> bool:
        """Read more of the body; False when there is no more."""
        if self.eof:
            return False
        data = self.stream.read(READ_BYTES)
        try:
            text = self._utf8.decode(data or b"", final=not data)
        except UnicodeDecodeError as exc:
            raise exceptions.ParseError(f"JSON parse error - body is not UTF-8 ({exc.reason})")
        if not data:
            self.eof = True
        self.offset += self.pos
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        return bool(data) or bool(text)

    def error(self, message: str) -> exceptions.ParseError:
        return exceptions.ParseError(
            f"JSON parse error - {message} at character {self.offset + self.pos}"
        )

    def peek(self) -> str | None:
        """The next non-whitespace character (not consumed), or None at the end of the body."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return None

    def take(self, char: str, what: str) -> None:
        if self.peek() != char:
            raise self.error(f"expected {what}")
        self.pos += 1

    def value(self, what: str, cap_error) -> object:
        """Decode the value that starts here; cap_error() is raised when it is larger than cap,
        ParseError when it is not JSON."""
        if self.peek() is None:
            raise self.error(f"expected {what}, got the end of the body")
        while True:
            try:
                return self._decode_here()
            except _Incomplete:
                if len(self.buf) - self.pos > self.cap:
                    raise cap_error() from None
                self._fill()  # at the end of the body, the next decode says what is wrong

    def _decode_here(self) -> object:
        try:
            obj, end = _DECODER.raw_decode(self.buf, self.pos)
        except json.JSONDecodeError as exc:
            if not self.eof and _may_continue(exc, len(self.buf)):
                raise _Incomplete() from None
            self.pos = exc.pos
            raise self.error(exc.msg.removesuffix(" at")) from None
        except RecursionError:
            raise self.error("nested too deeply") from None
        except ValueError as exc:
            # Python refuses to convert an integer of more than 4,300 digits (sys.int_info):
            # the body's fault, not the server's.
            raise self.error(str(exc)) from None
        if end - self.pos > self.cap:
            raise _Incomplete()
        if not self.eof and (end == len(self.buf) or self.buf[end] not in _AFTER_VALUE):
            # A number may go on in the next read ("-2.5" of "-2.5e3"); any other value ends
            # with its closing character.
            raise _Incomplete()
        self.pos = end
        return obj

    def at_end(self) -> None:
        if self.peek() is not None:
            raise self.error("unexpected data after the JSON document")


def _member_too_large(cap: int):
    return lambda: exceptions.ParseError(
        f"JSON parse error - a value outside \"queries\" is larger than {cap} characters"
    )


class JSONQueryArray:
    """The elements of the body's query array, decoded one at a time as they are iterated."""

    def __init__(self, reader: JSONStream, finish) -> None:
        self.reader = reader
        self._finish = finish  # reads what follows the array (the rest of the object), checks EOF

    def __iter__(self) -> Iterator[tuple[None, object]]:
        reader = self.reader
        if reader.peek() == "]":
            reader.pos += 1
            self._finish()
            return
        index = 0
        while True:
            yield None, reader.value(f"query {index}", self._too_large(index))
            after = reader.peek()
            if after == ",":
                reader.pos += 1
                index += 1
            elif after == "]":
                reader.pos += 1
                self._finish()
                return
            else:
                raise reader.error(f"expected ',' or ']' after query {index}")

    def _too_large(self, index: int):
        cap = self.reader.cap
        return lambda: exceptions.ValidationError(
            {index: [f"expected at most {cap} characters of JSON per query "
                     f"(MORPHO_BULK_MAX_QUERY_BYTES), got more"]}
        )


class StreamingBulkJSONParser(BaseParser):
    """`application/json` bulk bodies: `{"queries": [...]}` or a bare array, streamed.

    parse() reads only up to the opening of the query array; the queries are read as the
    serializer iterates them. Other members of the object are read whole, within the same cap.
    """

    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        cap = settings.MORPHO_BULK_MAX_QUERY_BYTES
        reader = JSONStream(stream, cap)
        first = reader.peek()
        if first is None:
            raise exceptions.ParseError("JSON parse error - the body is empty")
        if first == "[":
            reader.pos += 1
            return {"queries": JSONQueryArray(reader, reader.at_end)}
        if first != "{":
            value = reader.value("a JSON document", _member_too_large(cap))
            reader.at_end()
            return value
        reader.pos += 1
        members: dict = {}
        return self._members(reader, members, cap)

    def _members(self, reader: JSONStream, members: dict, cap: int):
        """Read members until the query array opens (handed over lazily) or the object ends."""
        if reader.peek() == "}":
            reader.pos += 1
            reader.at_end()
            return members
        while True:
            if reader.peek() != '"':
                raise reader.error("expected a member name in double quotes")
            name = reader.value("a member name", _member_too_large(cap))
            reader.take(":", "':' after a member name")
            if name == "queries" and "queries" in members:
                raise reader.error('"queries" given twice')
            if name == "queries" and reader.peek() == "[":
                reader.pos += 1
                members["queries"] = JSONQueryArray(
                    reader, lambda: self._after_queries(reader, members, cap))
                return members
            members[name] = reader.value(f"the value of {name!r}", _member_too_large(cap))
            if self._next_member(reader):
                reader.at_end()
                return members

    def _after_queries(self, reader: JSONStream, members: dict, cap: int) -> None:
        if self._next_member(reader):
            reader.at_end()
            return
        self._members(reader, members, cap)  # members after the array are read and dropped

    @staticmethod
    def _next_member(reader: JSONStream) -> bool:
        """Past the separator after a member: True when the object ended."""
        after = reader.peek()
        if after == ",":
            reader.pos += 1
            return False
        if after == "}":
            reader.pos += 1
            return True
        raise reader.error("expected ',' or '}' after a member")


def ndjson_lines(fileobj, cap: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line) for each line of at most `cap` bytes; (number, None) for a longer
    one, which is skipped without being held in memory. Reads READ_BYTES at a time."""
    pending = bytearray()
    skipping = False
    number = 0
    while True:
        chunk = fileobj.read(READ_BYTES)
        if isinstance(chunk, str):
            chunk = chunk.encode()
        if not chunk:
            break
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            stop = len(chunk) if newline < 0 else newline + 1
            if not skipping:
                if len(pending) + (stop - start) > cap + 1:  # +1: the newline itself
                    skipping = True
                    pending.clear()
                else:
                    pending += chunk[start:stop]
            start = stop
            if newline >= 0:
                number += 1
                yield number, None if skipping else bytes(pending)
                skipping = False
                pending.clear()
    if skipping or pending:
        yield number + 1, None if skipping else bytes(pending)


class QuerySpool:
    """Validated queries as key bytes, all of one size, in memory up to SPOOL_MEMORY_BYTES and in
    a temporary file beyond; iterated back in order, one query at a time."""

    def __init__(self) -> None:
        self._file = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)
        self._count = 0
        self._size: int | None = None

    def append(self, raw: bytes) -> None:
        if self._size is None:
            self._size = len(raw)
        elif len(raw) != self._size:
            raise ValueError(f"query of {len(raw)} key bytes in a spool of {self._size}")
        self._file.write(raw)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[bytes]:
        self._file.seek(0)
        for _ in range(self._count):
            yield self._file.read(self._size)

    def close(self) -> None:
        self._file.close()

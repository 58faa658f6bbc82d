"""The JSON answer of a query request, written straight to bytes (docs/PROTOCOL.md section 5.2).

`{"epoch_id": E, "pages": ["0x...", x3]}` for one query, `{"epoch_id": E, "results": [{"pages":
[...]}, ...]}` for a batch: each 4096-byte answer as 0x-prefixed lower-case hex. These are the
bytes DRF's JSONRenderer writes for the same dict (tests compare the two), made without building
one 8 KiB string per answer and having the JSON encoder scan each for characters to escape: that
took most of the web CPU of a 32-query request (786 KB of hex).
"""
from __future__ import annotations

import binascii

from rest_framework.renderers import JSONRenderer

HEX_PREFIX = "0x"  # section 5.2: answers are 0x-prefixed lower-case hex


class AnswerBody:
    """A BatchAnswer as the JSON body of `/query/page/gpu` (single) or of its batch endpoint."""

    def __init__(self, result, single: bool) -> None:
        self.result = result
        self.single = single

    @property
    def queries(self) -> int:
        return len(self.result.query_keys)

    def as_dict(self) -> dict:
        """The same body as Python data (what JSONRenderer would be given)."""
        pages = [[HEX_PREFIX + page.hex() for page in query] for query in self.result.pages]
        if self.single:
            return {"epoch_id": self.result.epoch_id, "pages": pages[0]}
        return {"epoch_id": self.result.epoch_id,
                "results": [{"pages": query} for query in pages]}

    def to_json(self) -> bytes:
        answers = self.result.answers
        digits = binascii.hexlify(memoryview(answers).cast("B"))  # every answer, in order
        width = 2 * answers.shape[1]
        view = memoryview(digits)
        parts = [b'{"epoch_id":%d,' % self.result.epoch_id,
                 b'"pages":[' if self.single else b'"results":[{"pages":[']
        row = 0
        for index, count in enumerate(self.result.query_keys):
            if index:
                parts.append(b']},{"pages":[')
            for key in range(count):
                parts += (b',"0x' if key else b'"0x', view[(row + key) * width:(row + key + 1) * width], b'"')
            row += count
        parts.append(b"]}" if self.single else b"]}]}")
        return b"".join(parts)


class AnswerJSONRenderer(JSONRenderer):
    """DRF's JSON renderer, but an AnswerBody is written by its to_json()."""

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, AnswerBody):
            return data.to_json()
        return super().render(data, accepted_media_type, renderer_context)

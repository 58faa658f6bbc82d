"""The API's JSON parser; in a module of its own, since DRF's settings import it while loading.

(queries/api/errors.py imports rest_framework.views, whose APIView reads DEFAULT_PARSER_CLASSES at
import: a parser named there and living in errors.py made a cycle wherever errors.py was the
first to load DRF's views, as `manage.py check` does in the image.)"""
from __future__ import annotations

from rest_framework import exceptions
from rest_framework.parsers import JSONParser


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, but a body nested too deeply for Python's parser is a 400, not a 500."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - nested too deeply") from None

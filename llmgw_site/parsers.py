"""Request bodies: JSON, and YAML so that `llmgw ctl model add -f` can send the file as written.

Both read at most DATA_UPLOAD_MAX_MEMORY_SIZE bytes (413 beyond it, before
parsing anything) and hold the parsed document to the bounds of
`core.yamltext` (values, depth, digits, finite numbers, unique keys), so a
hostile body gets a 400 that says what is wrong rather than a worker's memory
or a RecursionError.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from catalog.definitions import load_definition_text
from core import jsontext
from core.refusals import Refused
from core.yamltext import (
    DocumentRefused,
    check_document,
)


class YAMLDocument(dict):
    """A parsed YAML mapping that remembers the line of each value."""

    lines: dict[Any, int]


def read_body(stream: Any, parser_context: dict[str, Any] | None) -> bytes:
    """The body, refused with 413 (RequestDataTooBig) past the limit, before it is read.

    Django checks the limit only when its own form parsing reads the body; DRF's
    parsers read the stream directly, so the check is made here for every parser.
    """
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    request = (parser_context or {}).get("request")
    meta = getattr(request, "META", {}) if request is not None else {}
    try:
        declared = int(meta.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if limit is not None and declared > limit:
        raise RequestDataTooBig("Request body exceeded settings.DATA_UPLOAD_MAX_MEMORY_SIZE.")
    if stream is None:
        return b""
    raw = stream.read(limit + 1) if limit is not None else stream.read()
    if limit is not None and len(raw) > limit:
        raise RequestDataTooBig("Request body exceeded settings.DATA_UPLOAD_MAX_MEMORY_SIZE.")
    return raw


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ParseError(f"The body is not UTF-8 text; send the {what} as written.") from None


class YAMLParser(BaseParser):
    media_type = "application/yaml"

    def parse(self, stream, media_type=None, parser_context=None):
        text = _text(read_body(stream, parser_context), "YAML file")
        try:
            data, lines = load_definition_text(text)
        except Refused as exc:
            error = ParseError(exc.message)
            error.line = exc.problems[0].line  # type: ignore[attr-defined]
            raise error from None
        if isinstance(data, dict):
            document = YAMLDocument(data)
            document.lines = lines
            return document
        return data


class JSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        text = _text(read_body(stream, parser_context), "JSON")
        try:
            data = jsontext.loads(text)
        except jsontext.JSONRefused as exc:
            raise ParseError(f"The JSON body was refused: {exc}.") from None
        except json.JSONDecodeError as exc:
            raise ParseError(
                f"The body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
            ) from None
        except RecursionError:
            # CPython's decoder stops a deep document cleanly with RecursionError.
            raise ParseError(
                "The JSON body was refused: it is nested far too deep; a definition needs four levels."
            ) from None
        try:
            check_document(data)
        except DocumentRefused as exc:
            raise ParseError(f"The JSON body was refused: {exc}.") from None
        return data

"""A YAML request body, so that `llmgw ctl model add -f` can send the file as written."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from .yamltext import YAMLSyntaxError, load_with_lines


class YAMLDocument(dict):
    """A parsed YAML mapping that remembers the line of each value."""

    lines: dict[Any, int]


class YAMLParser(BaseParser):
    media_type = "application/yaml"

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read() if stream is not None else b""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ParseError("The body is not UTF-8 text; send the YAML file as written.") from None
        try:
            data, lines = load_with_lines(text)
        except YAMLSyntaxError as exc:
            error = ParseError(f"The definition is not valid YAML: {exc}.")
            error.line = exc.line  # type: ignore[attr-defined]
            raise error from None
        if isinstance(data, dict):
            document = YAMLDocument(data)
            document.lines = lines
            return document
        return data

"""JSON read with bounds: no number longer than MAX_DIGITS, no NaN or Infinity, and (for
documents people write) no key given twice in one object.

Python's decoder turns a 5,000-digit number into an int digit by digit and accepts NaN; both are
refused here before they reach a field. Depth is the caller's to bound: CPython's decoder stops a
very deep document with RecursionError, and core.yamltext.check_document walks what was read.
The API's JSON parser (llmgw_site.parsers) and the gateway's body reader (gateway.relay) both
read through :func:`loads`.
"""

from __future__ import annotations

import json
from typing import Any

from .yamltext import MAX_DIGITS


class JSONRefused(ValueError):
    """A document that is JSON but not one we take; the text completes "... was refused: "."""


def _whole_number(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_DIGITS:
        raise JSONRefused(
            f"a number with {digits} digits is larger than any field takes (at most {MAX_DIGITS})"
        )
    return int(text)


def _constant(name: str) -> float:
    raise JSONRefused(f"{name} is not a number JSON allows")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise JSONRefused(f"the key {key!r} is given twice in one object; keep one of them")
        document[key] = value
    return document


def loads(text: str | bytes, *, unique_keys: bool = True) -> Any:
    """The document in `text`.

    Raises JSONRefused for what is refused above, json.JSONDecodeError (a ValueError) for what is
    not JSON, UnicodeDecodeError for bytes that are not UTF-8, and RecursionError for a document
    nested beyond the interpreter's stack. unique_keys=False keeps the decoder's faster path for
    bodies that only a program reads (a repeated key then means its last value, as in JSON.parse).
    """
    if isinstance(text, bytes | bytearray):
        # As json.loads reads bytes: UTF-8, -16 or -32, told apart by the first bytes.
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    return (_STRICT if unique_keys else _LENIENT).decode(text)


# Made once: json.loads with hooks makes a decoder per call, a third of a small body's cost.
_STRICT = json.JSONDecoder(
    parse_int=_whole_number, parse_constant=_constant, object_pairs_hook=_unique_keys
)
_LENIENT = json.JSONDecoder(parse_int=_whole_number, parse_constant=_constant)

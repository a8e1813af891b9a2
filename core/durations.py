"""Durations as people write them in server.yaml and on the command line: 15m, 6h, 1h30m."""

from __future__ import annotations

import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+)([smhd])")
# Each figure has at most 9 digits: a longer one is beyond MAX_SECONDS anyway, and Python
# refuses to convert an integer of more than 4,300 digits at all.
_WHOLE = re.compile(r"(?:\d{1,9}[smhd]){1,4}")

# Nothing we schedule needs more than a year; a larger figure is a typo.
MAX_SECONDS = 366 * 86400


class DurationError(ValueError):
    pass


def parse_duration(text: object) -> int:
    """Seconds in a duration such as "15m", "6h", "1h30m" or "0"."""
    if isinstance(text, bool):
        raise DurationError("write a duration with its unit, like 15m or 6h")
    if isinstance(text, int) and text == 0:
        return 0
    if not isinstance(text, str):
        raise DurationError("write a duration with its unit, like 15m or 6h")
    value = text.strip().lower()
    if value == "0":
        return 0
    if not _WHOLE.fullmatch(value):
        shown = text if len(text) <= 40 else f"{text[:20]}…({len(text)} characters)"
        raise DurationError(
            f"{shown!r} is not a duration: use a number with a unit (s, m, h, d), like 15m, 6h or 1h30m"
        )
    seconds = sum(int(amount) * _UNITS[unit] for amount, unit in _PART.findall(value))
    if seconds > MAX_SECONDS:
        raise DurationError(f"{text!r} is longer than a year; that is not a sensible figure here")
    return seconds


def format_duration(seconds: int) -> str:
    """The shortest way to write a duration back: 900 -> "15m", 5400 -> "1h30m"."""
    if seconds == 0:
        return "0"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        amount, seconds = divmod(seconds, size)
        if amount:
            parts.append(f"{amount}{unit}")
    return "".join(parts)

"""The canary fields of the console's Update dialog, read into the settings registry.canary
checks (with the same words as the API and the command line)."""

from __future__ import annotations

from typing import Any

from core.refusals import Refused
from registry import canary

FIELDS = ("canary", "for", "max_error_rate", "max_latency_ratio")


def canary_from_form(data: Any) -> canary.CanarySettings | None:
    """The canary the Update dialog asks for; None when its percentage is left empty. A value
    that does not read as a number goes to the same check as the API's, which refuses it with
    the same words."""
    given = {name: str(data.get(name) or "").strip() for name in FIELDS}
    if not given["canary"]:
        if any(given[name] for name in FIELDS[1:]):
            raise Refused(
                "Canary time and limits only mean something for a canary update: give the "
                "percentage of requests the canary gets, or leave them all empty for an update "
                "that replaces every replica straight away.",
                code="invalid_canary",
            )
        return None
    return canary.canary_settings(
        percent=_number(given["canary"], int),
        window=given["for"] or None,
        max_error_rate=_number(given["max_error_rate"], float) if given["max_error_rate"] else None,
        max_latency_ratio=_number(given["max_latency_ratio"], float)
        if given["max_latency_ratio"]
        else None,
    )


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        return text

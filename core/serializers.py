"""The serializer kit every API input is made of: typed, strict, with durations and one way to
name a nested field's problem.

DRF guesses at types (`false` becomes 0, `5` becomes "5") and ignores fields it does not know;
inputs made of these refuse both, naming each field, so that one answer lists every problem.
"""

from __future__ import annotations

import difflib
import threading
from functools import cached_property
from typing import Any, cast

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.durations import format_duration

from .durations import DurationError, parse_duration
from .yamltext import Path


def wrong_type(field: serializers.Field, value: Any) -> str | None:
    """What is wrong with the JSON (or YAML) type of `value` for `field`, or None.

    DRF turns `false` into 0.0, `5` into "5" and "3" into 3; the API's schema promises
    numbers, text and true/false, so a value of another type is refused rather than guessed at.
    """
    if value is None:
        return None
    if isinstance(field, serializers.BooleanField):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(field, serializers.IntegerField):
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return None if whole and not isinstance(value, bool) else "must be a whole number"
    if isinstance(field, serializers.FloatField):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number else "must be a number"
    if isinstance(field, serializers.CharField | serializers.ChoiceField | serializers.UUIDField):
        return None if isinstance(value, str) else "must be text (quote it in YAML)"
    if isinstance(field, serializers.ListField) and isinstance(value, list):
        for item in value:
            problem = wrong_type(field.child, item)
            if problem:
                return f"each entry {problem}"
    return None


class TypedSerializer(serializers.Serializer):
    """Refuses values of the wrong JSON type (`cores: false` is not 0), naming each field."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            return super().to_internal_value(data)
        errors: dict[str, Any] = {}
        for key, value in data.items():
            if key in self.fields:
                problem = wrong_type(self.fields[key], value)
                if problem:
                    errors[str(key)] = [problem]
        try:
            value = super().to_internal_value(
                {k: v for k, v in data.items() if str(k) not in errors}
            )
        except serializers.ValidationError as exc:
            if not isinstance(exc.detail, dict):
                raise
            errors = {**cast(dict[str, Any], exc.detail), **errors}
        if errors:
            raise serializers.ValidationError(errors)
        return value


class FieldsOncePerThread(serializers.Serializer):
    """An input or an output whose fields (its nested serializers' included) are built once per
    thread and kept, for the requests that come by the thousand (a node's report and its
    answer, a renewal): DRF deep-copies every declared field, nested ones and their validators,
    for each instance (a node's report validated in 1.04 ms that way, 0.25 ms with its fields
    kept; a renewal's answer spent 7 % of its CPU building its output's fields).

    Safe only for a serializer whose validation or representation keeps no state on its fields
    and reads no context: the kept fields stay bound to a blank instance of the class, and one
    thread runs one validation or representation at a time."""

    _kept = threading.local()

    @cached_property
    def fields(self) -> Any:
        kept: dict[type, Any] = self._kept.__dict__.setdefault("fields", {})
        fields = kept.get(type(self))
        if fields is None:
            # DRF's own fields, of a blank instance: bound to it, not to this request's.
            fields = kept[type(self)] = serializers.Serializer.fields.func(type(self)())  # type: ignore[attr-defined]
        return fields


class StrictSerializer(TypedSerializer):
    """Refuses fields it does not know, by name: a misspelt field must not silently mean nothing.
    And values of the wrong type."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            return super().to_internal_value(data)
        known = set(self.fields)
        errors: dict[str, Any] = {}
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = (
                    f"did you mean {close[0]!r}?"
                    if close
                    else f"known fields: {', '.join(sorted(known))}"
                )
                errors[str(key)] = [f"unknown field; {hint}"]
        # The known fields are checked too, so that one answer lists every problem.
        try:
            value = super().to_internal_value({k: v for k, v in data.items() if k in known})
        except serializers.ValidationError as exc:
            if not isinstance(exc.detail, dict):
                raise
            errors = {**cast(dict[str, Any], exc.detail), **errors}
        if errors:
            raise serializers.ValidationError(errors)
        return value


@extend_schema_field(
    {
        "oneOf": [
            {
                "type": "string",
                "pattern": r"^\s*(0|([0-9]+[smhdSMHD])+)\s*$",
                "description": "a duration with its unit, like 15m, 6h or 1h30m; 0 for none",
            },
            {"type": "integer", "enum": [0]},
        ]
    }
)
class DurationField(serializers.Field):
    default_error_messages = {"invalid": "{message}"}

    def to_internal_value(self, data: Any) -> int:
        try:
            return parse_duration(data)
        except DurationError as exc:
            self.fail("invalid", message=str(exc))
            raise AssertionError("unreachable") from exc

    def to_representation(self, value: int) -> str:
        return format_duration(value)


def flatten_errors(detail: Any, path: Path = ()) -> list[tuple[Path, str]]:
    """DRF's nested error structure as (path, message) pairs."""
    if isinstance(detail, dict):
        pairs = []
        for key, value in detail.items():
            sub = path if key == "non_field_errors" else (*path, key)
            pairs.extend(flatten_errors(value, sub))
        return pairs
    if isinstance(detail, list):
        if all(isinstance(item, str) for item in detail):
            return [(path, str(item)) for item in detail]
        pairs = []
        for index, item in enumerate(detail):
            if item:
                pairs.extend(flatten_errors(item, (*path, index)))
        return pairs
    return [(path, str(detail))]


def path_text(path: Path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text

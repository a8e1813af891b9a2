"""Refusals: one shape for the API, the CLI, the console and server.yaml.

Every refusal is a full sentence saying what was wrong and what to do instead,
plus a stable code; problems with one field of a definition also name the field
and, when the definition came as YAML, its line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    line: int | None = None

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"field": self.field, "message": self.message}
        if self.line is not None:
            data["line"] = self.line
        return data

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        return f"{where}{self.field}: {self.message}" if self.field else f"{where}{self.message}"


@dataclass
class CatalogError(Exception):
    message: str
    code: str = "invalid"
    problems: list[Problem] = field(default_factory=list)
    status: int = 400

    def __str__(self) -> str:
        return self.message

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"detail": self.message, "code": self.code}
        if self.problems:
            data["problems"] = [p.as_dict() for p in self.problems]
        return data


def invalid(problems: list[Problem], *, what: str = "The definition") -> CatalogError:
    """A refusal listing every problem found, the first ones in the sentence itself."""
    listed = "; ".join(str(p).rstrip(".") for p in problems[:5])
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    # A last problem that asks (did you mean ...?) ends the sentence itself.
    end = "" if (listed + more).endswith("?") else "."
    return CatalogError(
        f"{what} was refused, nothing was changed: {listed}{more}{end}",
        code="invalid",
        problems=problems,
    )


def not_found(name: str, known: list[str] | None = None) -> CatalogError:
    hint = "; `llmgw ctl models` lists the models there are"
    if known:
        import difflib

        close = difflib.get_close_matches(name, known, n=3)
        if close:
            hint = f"; did you mean {', '.join(close)}?"
    end = "" if hint.endswith("?") else "."
    return CatalogError(
        f"There is no model named {name!r}{hint}{end}", code="not_found", status=404
    )


def forbidden(message: str) -> CatalogError:
    return CatalogError(message, code="forbidden", status=403)


def conflict(message: str, code: str = "conflict") -> CatalogError:
    return CatalogError(message, code=code, status=409)

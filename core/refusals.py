"""Refusals: one shape for the API, the CLI, the console, the admin and server.yaml.

Every app raises :class:`Refused` when it will not do what it was asked (a model definition, a
fetch, a node, a key, a canary): a full sentence saying what was wrong and what to do instead,
a stable code, and the HTTP status the API answers with (llmgw_site.api_errors turns it into the
answer; the console and the admin show the sentence). Problems with one field also name the
field and, when the input came as YAML, its line.

(gateway.limits.Refused is another thing: a request over a key's limit, answered in OpenAI's shape.)
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
class Refused(Exception):
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


def invalid(problems: list[Problem], *, what: str = "The definition") -> Refused:
    """A refusal listing every problem found, the first ones in the sentence itself."""
    listed = "; ".join(str(p).rstrip(".") for p in problems[:5])
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    # A last problem that asks (did you mean ...?) ends the sentence itself.
    end = "" if (listed + more).endswith("?") else "."
    return Refused(
        f"{what} was refused, nothing was changed: {listed}{more}{end}",
        code="invalid",
        problems=problems,
    )


def forbidden(message: str) -> Refused:
    return Refused(message, code="forbidden", status=403)


def conflict(message: str, code: str = "conflict") -> Refused:
    return Refused(message, code=code, status=409)

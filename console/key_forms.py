"""The Keys page's forms: they only turn text into the services' words; the services decide what
is allowed (a key's limits at most its team's and its ceilings, a weight only staff raise, a
member's key kept in their teams), so that the console, the API, the admin and the CLI cannot
disagree."""

from __future__ import annotations

from typing import Any

from django import forms

from access.forms import with_limit_fields
from access.services import COUNTERS, KEY_NAME_MAX
from llmgw.limitdefs import Limit

from .forms import ConsoleForm


def _counter(limit: Limit) -> dict[str, forms.Field]:
    return {
        limit.name: forms.CharField(
            label=limit.label,
            required=False,
            max_length=30,
            help_text=f"{limit.meaning}; empty, 0 or none: no limit",
            widget=forms.TextInput(attrs={"inputmode": "numeric", "placeholder": "no limit"}),
        )
    }


@with_limit_fields(_counter)
class KeyLimitsForm(ConsoleForm):
    """A key's limits, team and expiry, shown as they are; only what was changed is sent."""

    models = forms.CharField(
        label="Models",
        required=False,
        max_length=2000,
        help_text="names or globs, comma-separated (llama-*, qwen:support); empty: every model",
        widget=forms.TextInput(attrs={"placeholder": "every model"}),
    )
    weight = forms.CharField(
        label="Weight",
        required=False,
        max_length=20,
        help_text="its share of a model's slots when requests queue (1 by default; only staff "
        "raise it)",
    )
    team = forms.ChoiceField(label="Team", required=False)
    expires = forms.CharField(
        label="Expires",
        required=False,
        max_length=100,
        help_text="a duration from now (30d), a date (00:00 UTC) or none for never; empty keeps it",
    )

    problem_fields = {name: name for name in [*COUNTERS, "models", "weight", "team", "expires"]}
    # What is not sent when it was not changed (the services would take it as a change).
    SETTINGS = [*COUNTERS, "models", "weight", "team"]

    def __init__(
        self,
        *args: Any,
        teams: list[str],
        view: dict[str, Any] | None = None,
        no_team: bool = True,
        **kwargs: Any,
    ) -> None:
        """`teams` are those a key may go into; `no_team` whether it may be in none (a member
        of a team with limits keeps their keys in one: the services refuse it, and the form does
        not offer it, unless the key is in none now)."""
        if view is not None:
            kwargs.setdefault("auto_id", f"key-{view['id']}-%s")
            kwargs.setdefault("initial", _initial(view))
        super().__init__(*args, **kwargs)
        current = (view or {}).get("team")
        names = sorted({*teams, *([current] if current else [])})
        team = self.fields["team"]
        assert isinstance(team, forms.ChoiceField)
        offered = no_team or (view is not None and not current)
        team.choices = [*([("", "no team")] if offered else []), *((n, n) for n in names)]

    def changes(self) -> dict[str, Any]:
        data = self.cleaned_data
        changes = {name: data[name] for name in self.SETTINGS if name in self.changed_data}
        if data["expires"].strip():
            changes["expires"] = data["expires"]
        return changes


def _initial(view: dict[str, Any]) -> dict[str, Any]:
    limits = view["limits"]
    initial: dict[str, Any] = {
        name: "" if limits[name] is None else str(limits[name]) for name in COUNTERS
    }
    initial["models"] = ", ".join(limits["models"])
    initial["weight"] = f"{limits['weight']:g}"
    initial["team"] = view["team"] or ""
    return initial


class KeyCreateForm(KeyLimitsForm):
    name = forms.CharField(
        label="Name",
        max_length=KEY_NAME_MAX,
        help_text="what the key is for, say the application that will use it",
        error_messages={"required": "Give the key a name that says what it is for."},
    )

    field_order = ["name", "team", *COUNTERS, "models", "weight", "expires"]

    def __init__(self, *args: Any, teams: list[str], **kwargs: Any) -> None:
        kwargs.setdefault("auto_id", "new-key-%s")
        super().__init__(*args, teams=teams, **kwargs)
        self.fields[
            "expires"
        ].help_text = "a duration from now (30d), a date (00:00 UTC that day); empty: never"

    def changes(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {
            name: data[name]
            for name in [*self.SETTINGS, "expires"]
            if isinstance(data[name], str) and data[name].strip()
        }

"""The Teams page: the teams whose members' keys share limits, with their use against each limit.

Staff add teams here, set their limits, key policies and members and remove them, and set the
default key policy (for everyone's keys in no team); a team admin sets their team's members; a
user sees the teams they are in and their policies, read-only. Every change goes through access.services, as the API's and the CLI's do,
so the audit records who made it and the doors cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from access import selectors, services
from access.api import team_items
from access.forms import with_limit_fields
from access.models import KeyPolicy
from access.services import COUNTERS
from console import selectors as console_selectors
from console.forms import ConsoleForm
from console.key_forms import KeyLimitsForm
from core.actor import Actor
from core.refusals import Refused
from llmgw.limitdefs import RATES

from .keys import uses_against_limits
from .pages import HtmxHttpRequest, actor, login_required, render_page, wants_partial

TEAMS_PER_PAGE = 25
TEMPLATE = "console/teams.html"
LIMITS_DONE = "Limits in force now; the gateway holds them within a second."


# -- forms: text into the services' words (the services decide what is allowed) ---------------


@with_limit_fields(lambda limit: {limit.name: KeyLimitsForm.base_fields[limit.name]})
class TeamLimitsForm(ConsoleForm):
    """A team's limits, shown as they are; only what was changed is sent."""

    # The same fields, with the same words, as a key's limits on the Keys page.
    models = KeyLimitsForm.base_fields["models"]
    weight = forms.CharField(
        label="Weight",
        required=False,
        max_length=20,
        help_text="the team's share of a model's slots when requests queue, all its keys "
        "together (1 by default); its keys' weights are at most this",
    )

    problem_fields = {name: name for name in [*COUNTERS, "models", "weight"]}
    SETTINGS = [*COUNTERS, "models", "weight"]

    def __init__(self, *args: Any, view: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if view is not None:
            kwargs.setdefault("auto_id", f"team-{view['name']}-%s")
            kwargs.setdefault("initial", _initial(view))
        super().__init__(*args, **kwargs)

    def changes(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {name: data[name] for name in self.SETTINGS if name in self.changed_data}


def _initial(view: dict[str, Any]) -> dict[str, Any]:
    limits = view["limits"]
    initial: dict[str, Any] = {
        name: "" if limits[name] is None else str(limits[name]) for name in COUNTERS
    }
    initial["models"] = ", ".join(limits["models"])
    initial["weight"] = f"{limits['weight']:g}"
    return initial


def _usernames(text: str) -> list[str]:
    # "alice, bob" and "alice bob" both name two users, as `--add alice,bob` does in the CLI.
    return [name for name in text.replace(",", " ").split() if name]


class TeamCreateForm(TeamLimitsForm):
    name = forms.CharField(
        label="Name",
        max_length=200,
        help_text="letters, digits, '.', '_', '-' and ':', like research; part of URLs and "
        "commands",
        error_messages={"required": "Give the team a name, like research or support."},
    )
    members = forms.CharField(
        label="Members",
        required=False,
        max_length=5000,
        help_text="usernames, separated by commas or spaces; empty: none yet",
    )

    field_order = ["name", "members", *COUNTERS, "models", "weight"]
    problem_fields = {**TeamLimitsForm.problem_fields, "name": "name", "members": "members"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_id", "new-team-%s")
        super().__init__(*args, **kwargs)

    def changes(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {name: data[name] for name in self.SETTINGS if data[name].strip()}

    def member_names(self) -> list[str]:
        return _usernames(self.cleaned_data["members"])


def _policy_field(label: str, help_text: str) -> forms.CharField:
    return forms.CharField(
        label=label,
        required=False,
        max_length=30,
        help_text=f"{help_text}; empty, 0 or none: none",
        widget=forms.TextInput(attrs={"inputmode": "numeric", "placeholder": "none"}),
    )


class KeyPolicyForm(ConsoleForm):
    """A key policy's default and ceiling of each limit, shown as they are; only what was
    changed is sent."""

    PARTS = (("defaults", "default"), ("ceilings", "max"))
    problem_fields = {
        f"{part}.{name}": f"{prefix}_{name}" for part, prefix in PARTS for name in COUNTERS
    }

    def __init__(
        self, *args: Any, scope: str, policy: dict[str, Any] | None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("auto_id", f"policy-{scope.replace(':', '-')}-%s")
        if policy is not None:
            kwargs.setdefault(
                "initial",
                {
                    f"{prefix}_{name}": ""
                    if policy[part][name] is None
                    else str(policy[part][name])
                    for part, prefix in self.PARTS
                    for name in COUNTERS
                },
            )
        super().__init__(*args, **kwargs)
        for name in COUNTERS:
            label = KeyLimitsForm.base_fields[name].label
            self.fields[f"default_{name}"] = _policy_field(
                f"{label}: default", "what a new key gets when not given"
            )
            self.fields[f"max_{name}"] = _policy_field(
                f"{label}: ceiling", "the most an owner may set (keys above it are lowered)"
            )

    def parts(self) -> dict[str, dict[str, str]]:
        data = self.cleaned_data
        return {
            part: {
                name: data[f"{prefix}_{name}"]
                for name in COUNTERS
                if f"{prefix}_{name}" in self.changed_data
            }
            for part, prefix in self.PARTS
        }


def policy_done(lowered: int) -> str:
    lower = f" {lowered} key(s) above a ceiling were lowered to it." if lowered else ""
    return f"Key policy in force now: new keys get its defaults.{lower}"


def policy_text(policy: dict[str, Any] | None) -> str:
    """A key policy on one line, as the cards show it to members."""
    if policy is None:
        return ""
    parts = []
    for name in COUNTERS:
        default, ceiling = policy["defaults"][name], policy["ceilings"][name]
        if default is None and ceiling is None:
            continue
        figures = [f"default {default:,}"] if default is not None else []
        figures += [f"ceiling {ceiling:,}"] if ceiling is not None else []
        parts.append(f"{KeyLimitsForm.base_fields[name].label} {', '.join(figures)}")
    return " · ".join(parts) or "no defaults or ceilings"


class TeamMembersForm(ConsoleForm):
    add = forms.CharField(
        label="Add",
        required=False,
        max_length=5000,
        help_text="usernames, separated by commas or spaces",
    )
    remove = forms.CharField(
        label="Remove",
        required=False,
        max_length=5000,
        help_text="usernames; a member removed keeps their keys in the team, held to its "
        "limits, until they or staff move them",
    )

    # The services' problems name "members", either field's: their sentence goes on top.
    problem_fields: dict[str, str] = {}

    def __init__(self, *args: Any, view: dict[str, Any], **kwargs: Any) -> None:
        kwargs.setdefault("auto_id", f"team-{view['name']}-members-%s")
        super().__init__(*args, **kwargs)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not _usernames(data.get("add", "")) and not _usernames(data.get("remove", "")):
            raise forms.ValidationError("Say whom to add or remove: give at least one username.")
        return data

    def names(self) -> dict[str, list[str]]:
        return {
            "add": _usernames(self.cleaned_data["add"]),
            "remove": _usernames(self.cleaned_data["remove"]),
        }


# -- views ------------------------------------------------------------------------------------


@require_GET
@login_required
def teams_page(request: HtmxHttpRequest) -> HttpResponse:
    who = actor(request)
    return render_page(request, TEMPLATE, "teams-body", _page(request, who, TeamCreateForm()))


@require_POST
@login_required
def team_create(request: HtmxHttpRequest) -> HttpResponse:
    who = actor(request)
    form = TeamCreateForm(request.POST)
    if not form.is_valid():
        return render_page(request, TEMPLATE, "teams-body", _page(request, who, form), 400)
    try:
        team = services.team_add(
            actor=who,
            name=form.cleaned_data["name"],
            limits=form.changes(),
            members=form.member_names(),
        )
    except Refused as refusal:
        form.refuse(refusal)
        context = _page(request, who, form)
        if not who.is_staff:  # the form is not on their page: say why on top
            context["refusal"] = refusal.message
        return render_page(request, TEMPLATE, "teams-body", context, refusal.status)
    context = _page(request, who, TeamCreateForm())
    context["done"] = f"Team {team.name} added."
    return render_page(request, TEMPLATE, "teams-body", context, 201)


@require_POST
@login_required
def team_limits(request: HtmxHttpRequest, name: str) -> HttpResponse:
    def change(who: Actor, form: TeamLimitsForm) -> str:
        services.team_set_limits(actor=who, name=name, changes=form.changes())
        return LIMITS_DONE

    return _team_change(
        request, name, "limits_form", lambda view: TeamLimitsForm(request.POST, view=view), change
    )


@require_POST
@login_required
def team_policy(request: HtmxHttpRequest, name: str) -> HttpResponse:
    scope = f"team:{name}"

    def change(who: Actor, form: KeyPolicyForm) -> str:
        _, lowered = services.policy_set(actor=who, scope=scope, **form.parts())
        return policy_done(lowered)

    def make_form(view: dict[str, Any]) -> KeyPolicyForm:
        return KeyPolicyForm(request.POST, scope=scope, policy=view["policy"])

    return _team_change(request, name, "policy_form", make_form, change)


@require_POST
@login_required
def default_policy(request: HtmxHttpRequest) -> HttpResponse:
    """The default key policy: for everyone's keys in no team (staff)."""
    who = actor(request)
    form = KeyPolicyForm(request.POST, scope="default", policy=_default_policy())
    if not form.is_valid():
        return _refused_policy(request, who, form, status=400)
    try:
        _, lowered = services.policy_set(actor=who, scope="default", **form.parts())
    except Refused as refusal:
        form.refuse(refusal)
        return _refused_policy(request, who, form, refusal=refusal)
    return _page_answer(request, who, policy_done(lowered))


def _refused_policy(
    request: HtmxHttpRequest,
    who: Actor,
    form: KeyPolicyForm,
    *,
    refusal: Refused | None = None,
    status: int = 400,
) -> HttpResponse:
    context = _page(request, who, TeamCreateForm(), policy_form=form)
    if refusal is not None and not who.is_staff:  # the form is not on their page: say why on top
        context["refusal"] = refusal.message
    return render_page(
        request, TEMPLATE, "teams-body", context, refusal.status if refusal else status
    )


@require_POST
@login_required
def team_members(request: HtmxHttpRequest, name: str) -> HttpResponse:
    def change(who: Actor, form: TeamMembersForm) -> str:
        team = services.team_members(actor=who, name=name, **form.names())
        members = sorted(team.members.values_list("username", flat=True))
        return f"Team {team.name} has {len(members)} member(s): {', '.join(members) or 'none'}."

    return _team_change(
        request, name, "members_form", lambda view: TeamMembersForm(request.POST, view=view), change
    )


def _team_change(
    request: HtmxHttpRequest,
    name: str,
    form_name: str,
    make_form: Callable[[dict[str, Any]], Any],
    change: Callable[[Actor, Any], str],
) -> HttpResponse:
    """One of a team's cards' forms: bound by `make_form` to the team's view, made by `change`,
    which returns what was done. The card answers with the form where it was refused."""
    who = actor(request)
    view = _visible(who, name)
    if view is None:
        return _missing(request, who, name)
    form = make_form(view)
    if not form.is_valid():
        return _card_answer(request, who, name, status=400, **{form_name: form})
    try:
        done = change(who, form)
    except Refused as refusal:
        form.refuse(refusal)
        return _card_answer(request, who, name, refusal=refusal, **{form_name: form})
    return _card_answer(request, who, name, done=done)


@require_POST
@login_required
def team_remove(request: HtmxHttpRequest, name: str) -> HttpResponse:
    who = actor(request)
    if _visible(who, name) is None:
        return _missing(request, who, name)
    try:
        keys = services.team_remove(actor=who, name=name)
    except Refused as refusal:
        context = _page(request, who, TeamCreateForm())
        context["refusal"] = refusal.message
        return render_page(request, TEMPLATE, "teams-body", context, refusal.status)
    done = f"Team {name} removed; its {keys} key(s) stay, without the team's limits."
    return _page_answer(request, who, done)


def _page_answer(request: HtmxHttpRequest, who: Actor, done: str) -> HttpResponse:
    """A change to the page as a whole: htmx gets the page's body with `done` on top; a plain
    form post, a redirect to the page, which says it."""
    if not wants_partial(request):
        messages.success(request, done)
        return HttpResponseRedirect(reverse("console-teams"))
    context = _page(request, who, TeamCreateForm())
    context["done"] = done
    return render_page(request, TEMPLATE, "teams-body", context)


# -- the page's parts -------------------------------------------------------------------------


def _default_policy() -> dict[str, Any] | None:
    found = KeyPolicy.objects.filter(kind="default").first()
    return selectors.policy_figures(found)


def _page(
    request: HtmxHttpRequest,
    who: Actor,
    create_form: TeamCreateForm,
    *,
    policy_form: KeyPolicyForm | None = None,
) -> dict[str, Any]:
    page = console_selectors.page_of(
        selectors.teams_visible_to(who), request.GET.get("page"), TEAMS_PER_PAGE
    )
    default = _default_policy()
    cards = [_card(view, who) for view in team_items(page.object_list)]
    context = {
        "cards": cards,
        "create_form": create_form,
        "staff": who.is_staff,
        "page": page,
        "default_policy": policy_text(default),
        "team_admin_of": [c["view"]["name"] for c in cards if "members_form" in c],
    }
    if who.is_staff:
        context["default_policy_form"] = policy_form or KeyPolicyForm(
            scope="default", policy=default
        )
    return context


def _card(
    view: dict[str, Any],
    who: Actor,
    *,
    limits_form: TeamLimitsForm | None = None,
    members_form: TeamMembersForm | None = None,
    policy_form: KeyPolicyForm | None = None,
) -> dict[str, Any]:
    limits, usage = view["limits"], view["usage"]
    rates = [
        (
            KeyLimitsForm.base_fields[name].label,
            "no limit" if limits[name] is None else f"{limits[name]:,}",
        )
        for name in RATES
    ]
    card: dict[str, Any] = {
        "view": view,
        "uses": uses_against_limits(view),
        "counted_now": usage.get("in_flight") is not None,
        "rates": rates,
        "requests_today": f"{usage['requests_today']:,}",
        "weight": f"{limits['weight']:g}",
        "policy": policy_text(view["policy"]),
    }
    # Only those who may change a team get its forms: the others get none to fill in vain.
    if who.is_staff:
        card["limits_form"] = limits_form or TeamLimitsForm(view=view)
        card["policy_form"] = policy_form or KeyPolicyForm(
            scope=f"team:{view['name']}", policy=view["policy"]
        )
    if who.is_staff or _team_admin(who, view):
        card["members_form"] = members_form or TeamMembersForm(view=view)
    return card


def _team_admin(who: Actor, view: dict[str, Any]) -> bool:
    """Whether `who` is a team admin of the team shown (its view lists them: access.roles)."""
    return who.user is not None and who.user.get_username() in view["admins"]


def _visible(who: Actor, name: str) -> dict[str, Any] | None:
    team = selectors.team_visible_to(who, name)
    return team_items([team])[0] if team is not None else None


def _card_answer(
    request: HtmxHttpRequest,
    who: Actor,
    name: str,
    *,
    limits_form: TeamLimitsForm | None = None,
    members_form: TeamMembersForm | None = None,
    policy_form: KeyPolicyForm | None = None,
    refusal: Refused | None = None,
    done: str = "",
    status: int = 200,
) -> HttpResponse:
    """htmx gets the team's card back with what happened in it; a plain form post, the page."""
    if refusal is not None:
        status = refusal.status
    view = _visible(who, name)
    if view is None:  # removed by someone else meanwhile
        return _missing(request, who, name)
    card = _card(
        view, who, limits_form=limits_form, members_form=members_form, policy_form=policy_form
    )
    # A refusal without its form on the card (a member changes nothing) is said in the card.
    form_shown = members_form is not None and "members_form" in card
    shown_on_form = who.is_staff or form_shown
    card["error"] = refusal.message if refusal is not None and not shown_on_form else ""
    card["done"] = done
    if not wants_partial(request):
        if status == 200:
            messages.success(request, done)
            return HttpResponseRedirect(reverse("console-teams"))
        # The page, the team's card on top with the refused form in it (it may be on another page).
        context = _page(request, who, TeamCreateForm())
        others = [c for c in context["cards"] if c["view"]["name"] != name]
        context["cards"] = [card, *others]
        return render(request, TEMPLATE, context, status=status)
    context = {"card": card, "staff": who.is_staff}
    return render(request, f"{TEMPLATE}#team-card", context, status=status)


def _missing(request: HtmxHttpRequest, who: Actor, name: str) -> HttpResponse:
    # A team one is not in is reported as missing, as the API does.
    context = _page(request, who, TeamCreateForm())
    context["refusal"] = (
        f"There is no team named {name[:100]!r} of yours; the Teams page lists them."
    )
    return render(request, TEMPLATE, context, status=404)

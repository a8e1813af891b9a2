"""The Keys page: a user's own gateway keys, and a team admin's teams' (staff: everyone's), made,
limited and revoked here (access.roles says who may: a viewer makes none).

A new key is shown once, in the answer to its creation, and kept nowhere in clear (not in the
session's messages either, which a cookie may hold).
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from access import policies, roles, selectors, services
from access.api import key_items
from access.models import GatewayKey, Team
from access.services import COUNTERS, limits_of
from console import selectors as console_selectors
from console.key_forms import KeyCreateForm, KeyLimitsForm
from core.actor import Actor
from core.refusals import Refused
from llmgw.limitdefs import LIMITS, RATES

from .pages import HtmxHttpRequest, actor, login_required, render_page, wants_partial

KEYS_PER_PAGE = 25
# Each limit and the use counted against it (the API's usage figures): the rates' as the gateway
# counts them now, the budgets' as the traffic book last wrote them.
USES = [(limit.name, limit.used, limit.used_label) for limit in LIMITS]


@require_GET
@login_required
def keys_page(request: HtmxHttpRequest) -> HttpResponse:
    who = actor(request)
    return render_page(
        request,
        "console/keys.html",
        "keys-body",
        _page(request, who, KeyCreateForm(**_teams(who))),
    )


@require_POST
@login_required
def key_create(request: HtmxHttpRequest) -> HttpResponse:
    who = actor(request)
    form = KeyCreateForm(request.POST, **_teams(who))
    if not form.is_valid():
        return render_page(
            request, "console/keys.html", "keys-body", _page(request, who, form), 400
        )
    changes = form.changes()
    try:
        key, secret = services.key_create(actor=who, name=form.cleaned_data["name"], limits=changes)
    except Refused as error:
        form.refuse(error)
        return render_page(
            request, "console/keys.html", "keys-body", _page(request, who, form), error.status
        )
    context = _page(request, who, KeyCreateForm(**_teams(who)))
    context["created"] = {"id": key.pk, "name": key.name, "secret": secret}
    return render_page(request, "console/keys.html", "keys-body", context, 201)


@require_POST
@login_required
def key_limits(request: HtmxHttpRequest, key_id: int) -> HttpResponse:
    who = actor(request)
    view = _visible(who, key_id)
    if view is None:
        return _missing(request, who, key_id)
    form = KeyLimitsForm(request.POST, **_teams(who), view=view)
    done = ""
    status = 200
    if not form.is_valid():
        status = 400
    else:
        try:
            services.key_set_limits(actor=who, key_id=key_id, changes=form.changes())
        except Refused as refusal:
            form.refuse(refusal)
            status = refusal.status
        else:
            done = "Limits in force now; the gateway holds them within a second."
    refused = form if status != 200 else None
    return _card_answer(request, who, key_id, form=refused, done=done, status=status)


@require_POST
@login_required
def key_revoke(request: HtmxHttpRequest, key_id: int) -> HttpResponse:
    who = actor(request)
    try:
        key = services.key_revoke(actor=who, key_id=key_id)
    except Refused as refusal:
        if refusal.status != 403:
            return _missing(request, who, key_id)
        # A teammate's key: the refusal names the role it needs (access.roles).
        return _missing(request, who, key_id, message=refusal.message, status=403)
    done = f"{key.prefix}… ({key.name}) is revoked: requests with it get 401."
    return _card_answer(request, who, key_id, done=done)


# -- the page's parts ---------------------------------------------------------------------


def _teams(who: Actor) -> dict[str, Any]:
    """The teams a key may be put in here, as the forms take them: the user's own (staff: every
    team), only those with limits when they are in any (access.policies), and whether none."""
    if not who.is_staff:
        binding = policies.binding_teams(who.user)
        if binding:
            return {"teams": [team.name for team in binding], "no_team": False}
    return {"teams": [team.name for team in selectors.teams_visible_to(who)], "no_team": True}


def _page(request: HtmxHttpRequest, who: Actor, create_form: KeyCreateForm) -> dict[str, Any]:
    teams = _teams(who)
    # A page at a time: staff see every user's keys, and there may be a great many.
    page = console_selectors.page_of(
        selectors.keys_visible_to(who), request.GET.get("page"), KEYS_PER_PAGE
    )
    views = key_items(page.object_list)
    held = teams_limits(views)
    return {
        "cards": [
            _card(view, KeyLimitsForm(**teams, view=view), held.get(view["team"])) for view in views
        ],
        "create_form": create_form,
        "staff": who.is_staff,
        "me": who.name,
        "makes_keys": roles.may(who, "keys.make"),
        "team_admin_of": sorted(
            Team.objects.filter(pk__in=roles.teams_where(who.user, "team.keys")).values_list(
                "name", flat=True
            )
        )
        if who.user is not None and not who.is_staff
        else [],
        "page": page,
    }


def teams_limits(views: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The limits of these keys' teams, by the team's name, in one query."""
    names = {view["team"] for view in views if view["team"]}
    return {team.name: limits_of(team) for team in Team.objects.filter(name__in=names)}


def uses_against_limits(
    view: dict[str, Any], team: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """A key's or team's use against each of its limits, as bars; a rate the gateway does not
    count (nothing of it is limited) is left out rather than shown as 0. A key's use against a
    limit it has none of is bound by its team's (`team`: the team's limits), which counts all
    the team's keys together, so that one is named rather than a bar drawn."""
    limits, usage = view["limits"], view["usage"]
    uses = []
    for limit, used, label in USES:
        figure, amount = limits[limit], usage.get(used)
        if amount is None:
            continue
        percent = min(100, round(100 * amount / figure)) if figure else 0
        teams = team[limit] if team and not figure else None
        uses.append(
            {
                "label": label,
                "limit": figure,
                "used_text": f"{amount:,}",
                "limit_text": f"{figure:,}" if figure else "",
                "percent": percent,
                "team_text": f"the team's limit {teams:,}, all its keys together" if teams else "",
            }
        )
    return uses


def binding_text(own: int | None, team: int | None) -> str:
    """What limits a key: its own figure, or its team's where the key has none or the team's is
    lower (staff may lower a team's limit below a key's; the lower one holds)."""
    if team is not None and (own is None or team < own):
        return f"{team:,} (team)" if own is None else f"{team:,} (team; the key's own {own:,})"
    return "no limit" if own is None else f"{own:,}"


def _card(view: dict[str, Any], form: KeyLimitsForm, team: dict[str, Any] | None) -> dict[str, Any]:
    """A key's card; `team` holds its team's limits (teams_limits), None without a team."""
    limits, usage = view["limits"], view["usage"]
    state = "expired" if view["expired"] and view["state"] == "active" else view["state"]
    rates = [
        (
            KeyLimitsForm.base_fields[name].label,
            binding_text(limits[name], team[name] if team else None),
        )
        for name in RATES
    ]
    models = ", ".join(limits["models"]) or "every model"
    if not limits["models"] and team and team["models"]:
        models = ", ".join(team["models"]) + " (team)"
    return {
        "view": view,
        "state": state,
        "ceilings": ceilings_shown(view),
        "uses": uses_against_limits(view, team),
        "models": models,
        "counted_now": usage.get("in_flight") is not None,
        "rates": rates,
        "requests_today": f"{usage['requests_today']:,}",
        "weight": f"{limits['weight']:g}",
        "expires": _minute(view["expires_at"]),
        "last_used": _minute(view["last_used_at"]) + " UTC" if view["last_used_at"] else "",
        "form": form,
    }


def ceilings_shown(view: dict[str, Any]) -> list[tuple[str, str]]:
    """A key's ceilings, by the forms' labels: what its owner may lower and not raise."""
    ceilings = view["ceilings"]
    shown = [
        (str(KeyLimitsForm.base_fields[name].label or name), f"{ceilings[name]:,}")
        for name in COUNTERS
        if ceilings[name] is not None
    ]
    if ceilings["models"]:
        shown.append(("Models", ", ".join(ceilings["models"])))
    if ceilings["expires_at"]:
        shown.append(("Expires", _minute(ceilings["expires_at"]) + " UTC"))
    return shown


def _minute(when: str | None) -> str:
    """An ISO time from a view, to the minute, as the console shows times (UTC)."""
    return when[:16].replace("T", " ") if when else ""


def _visible(who: Actor, key_id: int) -> dict[str, Any] | None:
    key = selectors.keys_visible_to(who).filter(pk=key_id).first() if key_id < 2**62 else None
    return key_items([key])[0] if isinstance(key, GatewayKey) else None


def _card_answer(
    request: HtmxHttpRequest,
    who: Actor,
    key_id: int,
    *,
    form: KeyLimitsForm | None = None,
    done: str = "",
    status: int = 200,
) -> HttpResponse:
    """htmx gets the key's card back with what happened in it; a plain form post, the page."""
    view = _visible(who, key_id)
    assert view is not None  # it was just changed by someone allowed to see it
    team = teams_limits([view]).get(view["team"])
    if not wants_partial(request):
        if status == 200:
            messages.success(request, done)
            return HttpResponseRedirect(reverse("console-keys"))
        # The page, the refused form in the key's card (on top, as the key may be on another page).
        context = _page(request, who, KeyCreateForm(**_teams(who)))
        others = [c for c in context["cards"] if c["view"]["id"] != key_id]
        context["cards"] = [_card(view, form or KeyLimitsForm(**_teams(who), view=view), team)]
        context["cards"] += others
        return render(request, "console/keys.html", context, status=status)
    card = _card(view, form or KeyLimitsForm(**_teams(who), view=view), team)
    context = {"card": card, "done": done, "staff": who.is_staff, "me": who.name}
    return render(request, "console/keys.html#key-card", context, status=status)


def _missing(
    request: HtmxHttpRequest, who: Actor, key_id: int, *, message: str = "", status: int = 404
) -> HttpResponse:
    # Someone else's key is reported as missing, as the API does.
    message = message or f"There is no gateway key {key_id} of yours; the Keys page lists them."
    context = _page(request, who, KeyCreateForm(**_teams(who)))
    context["refusal"] = message
    return render(request, "console/keys.html", context, status=status)

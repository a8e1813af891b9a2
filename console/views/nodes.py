"""The nodes page: every node with its replicas and capacity; cordon and uncordon."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from console import selectors as console_selectors
from console import traffic as console_traffic
from core.refusals import Refused
from fleet import selectors as fleet_selectors
from fleet import services as fleet_services

from .pages import HtmxHttpRequest, actor, login_required, wants_partial


@require_GET
@login_required
def nodes_page(request: HtmxHttpRequest) -> HttpResponse:
    cards = console_selectors.node_cards(
        fleet_selectors.nodes_view(addresses=request.user.is_staff)
    )
    context = {"nodes": cards, "capacity": console_traffic.capacity_chart()}
    return render(request, "console/nodes.html", context)


@require_POST
@login_required
def node_cordon(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _cordon_answer(request, name, cordoned=True)


@require_POST
@login_required
def node_uncordon(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _cordon_answer(request, name, cordoned=False)


def _cordon_answer(request: HtmxHttpRequest, name: str, *, cordoned: bool) -> HttpResponse:
    """Cordon or uncordon a node; htmx gets the node's card back, with what happened in it."""
    error: Refused | None = None
    try:
        node = fleet_services.node_cordon(actor=actor(request), name=name, cordoned=cordoned)
    except Refused as exc:
        error = exc
    done = ""
    if error is None:
        done = (
            f"{node.name} is cordoned: it keeps its replicas, and nothing new is placed there."
            if cordoned
            else f"{node.name} is uncordoned: new replicas may be placed there again."
        )
        if not wants_partial(request):
            messages.success(request, done)
            return HttpResponseRedirect(reverse("console-nodes"))
    cards = {
        c["name"]: c
        for c in console_selectors.node_cards(
            fleet_selectors.nodes_view(addresses=request.user.is_staff)
        )
    }
    status = error.status if error else 200
    if wants_partial(request) and name in cards:
        context: dict[str, Any] = {
            "node": cards[name],
            "error": error.message if error else "",
            "done": done,
        }
        return render(request, "console/nodes.html#node-card", context, status=status)
    page: dict[str, Any] = {
        "nodes": list(cards.values()),
        "refusal": error.message if error else "",
    }
    return render(request, "console/nodes.html", page, status=status)

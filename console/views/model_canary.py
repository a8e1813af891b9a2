"""Promote and Abort of a canary update on the model page (registry.canary). The answers are
the registry part of the page, like the other buttons in it (model_registry); the Update
dialog's canary fields are read by console.canary_form."""

from __future__ import annotations

from django.http import HttpResponse
from django.views.decorators.http import require_POST

from core.refusals import Refused
from registry import canary

from .model_registry import _registry_answer
from .pages import HtmxHttpRequest, actor, get_model, login_required


def _canary_action(request: HtmxHttpRequest, name: str, what: str) -> HttpResponse:
    model = get_model(name)
    act = canary.promote_canary if what == "promote" else canary.abort_canary
    try:
        act(actor=actor(request), name=model.name)
    except Refused as error:
        return _registry_answer(request, model, error=error)
    done = (
        f"Canary of {model.name} promoted: the other replicas move to the new revision one at a time."
        if what == "promote"
        else f"Canary of {model.name} aborted: back to the old revision, whose replicas serve on."
    )
    return _registry_answer(request, model, done=done)


@require_POST
@login_required
def canary_promote(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _canary_action(request, name, "promote")


@require_POST
@login_required
def canary_abort(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _canary_action(request, name, "abort")

"""The registry part of a model's page: its origin and update, and the buttons that act on them.

Update and rollback start a rollout; check asks the registry now. The part is polled
while a rollout runs; in the models list the same buttons answer with the model's row.
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from catalog.config import current_config
from catalog.models import Model
from console import selectors as console_selectors
from console.canary_form import canary_from_form
from core.actor import Actor
from core.durations import format_duration
from core.refusals import Refused, forbidden
from registry import canary, rollouts, updates

from .model import model_context
from .models import with_sparklines
from .pages import HtmxHttpRequest, actor, get_model, login_required, render_partials, wants_partial

# What the model page's poll of its registry part also refreshes, out of band: a
# rollout changes the source, the replicas and the history while it runs.
REFRESHED_BY_ROLLOUT = ["summary-oob", "replicas-oob", "history-oob"]


def _registry_answer(
    request: HtmxHttpRequest,
    model: Model,
    *,
    done: str = "",
    warning: str = "",
    error: Refused | None = None,
) -> HttpResponse:
    """The registry part again, with what happened; the whole page for a request without htmx.

    In the models list (`in=list`) the answer is the model's whole row, so that its
    replicas and source follow a rollout too; on the model page the part also holds the
    origin, previous revision and update, and the answer refreshes the summary,
    replicas and history out of band.
    """
    status = error.status if error else 200
    if not wants_partial(request):
        if error is not None:
            context = model_context(request, model, refusal=error.message)
            return render(request, "console/model.html", context, status=status)
        if warning:
            messages.warning(request, warning)
        else:
            messages.success(request, done)
        return HttpResponseRedirect(reverse("console-model", args=[model.name]))
    model = get_model(model.name)
    if request.POST.get("in", request.GET.get("in")) == "list":
        context = {
            "row": with_sparklines(console_selectors.model_rows([model], request.user))[0],
            "registry_done": done,
            "registry_warning": warning,
            "registry_error": error.message if error else "",
        }
        return render(request, "console/models.html#model-row", context, status=status)
    context = model_context(request, model)
    context.update(
        registry_done=done, registry_warning=warning, registry_error=error.message if error else ""
    )
    return render_partials(
        request, "console/model.html", ["registry", *REFRESHED_BY_ROLLOUT], context, status
    )


def _registry_action(request: HtmxHttpRequest, name: str, what: str) -> HttpResponse:
    model = get_model(name)
    try:
        settings_ = canary_from_form(request.POST) if what == "update" else None
        if settings_ is not None:
            rollout = canary.start_canary_update(
                actor=actor(request), name=model.name, settings_=settings_
            )
        else:
            start = rollouts.start_update if what == "update" else rollouts.start_rollback
            rollout = start(actor=actor(request), name=model.name)
    except Refused as error:
        return _registry_answer(request, model, error=error)
    before, after = rollout.from_commit[:7] or "?", rollout.to_commit[:7] or "?"
    done = (
        f"Rollback of {model.name} started ({before} → {after}): replicas go back to the "
        "previous files, one at a time."
        if what == "rollback"
        else f"Update of {model.name} started ({before} → {after}): the new files are fetched and "
        "checked, then "
        + (
            f"a canary replica gets {settings_.percent}% of the requests for "
            f"{format_duration(settings_.window_seconds)} before the others follow."
            if settings_ is not None
            else "replicas are replaced one at a time."
        )
    )
    return _registry_answer(request, model, done=done)


@require_POST
@login_required
def model_update(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _registry_action(request, name, "update")


@require_POST
@login_required
def model_rollback(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _registry_action(request, name, "rollback")


@require_POST
@login_required
def model_check(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Ask the registry now rather than at the next scheduled check.

    The check itself covers every served model (a request per repository); on a
    model's page it is offered to those who can act on what it finds, the model's
    owner and staff, and the answer is about that model.
    """
    model = get_model(name)
    if not model.may_be_changed_by(request.user):
        every = format_duration(current_config().update_check)
        owner = model.owner.username if model.owner else "nobody"
        error = forbidden(
            f"{model.name} belongs to {owner}; only they or a staff user may ask the registry "
            f"about it now. The registry is asked every {every} anyway."
        )
        return _registry_answer(request, model, error=error)
    report = updates.check_updates(actor=Actor.for_user(request.user, "console"))
    model = get_model(model.name)
    registry = console_selectors.model_rows([model], request.user)[0].registry
    origin = model.origin or {}
    failure = report.failures.get(origin.get("repo", ""))
    if failure or model.update_check_error:
        reason = failure or model.update_check_error.removeprefix("last check failed: ")
        return _registry_answer(
            request,
            model,
            warning=f"The check did not finish for {model.name}: {reason}. "
            "The registry is asked again at the next check.",
        )
    if registry.update:
        return _registry_answer(request, model, done=f"Checked: {registry.update_text}.")
    if origin:
        return _registry_answer(
            request,
            model,
            done=f"Checked: {model.name} is on the newest files of {origin['repo']} "
            f"({origin.get('branch', 'main')}, {origin['commit'][:7]}).",
        )
    return _registry_answer(
        request,
        model,
        warning=f"{model.name} does not follow a registry: its source is not a file the mirror "
        "fetched, so there is nothing to check it against.",
    )


@require_GET
@login_required
def model_registry(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The registry part of a model (badge, buttons, rollout progress), polled while a rollout runs."""
    model = get_model(name)
    if not wants_partial(request):
        return HttpResponseRedirect(reverse("console-model", args=[model.name]))
    return _registry_answer(request, model)

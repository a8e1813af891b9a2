"""A model's page and its forms: scale, resources, class, owner, adapters, restart, remove.

Each form posts to its own view, which calls the one service that makes the change. An
htmx answer is the form again, with what is now in force, and the parts of the page the
change touches, out of band; without htmx the page reloads with a message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml
from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseClientRedirect

from access import live, traffic
from catalog import selectors as catalog_selectors
from catalog import services
from catalog.config import current_config
from catalog.models import Model
from console import forms
from console import selectors as console_selectors
from console import traffic as console_traffic
from core.durations import format_duration
from core.refusals import Refused
from registry.canary import canary_view

from .pages import (
    HtmxHttpRequest,
    actor,
    get_model,
    login_required,
    render_partials,
    wants_partial,
)

# What an htmx answer to a change also refreshes, out of band.
REFRESHED = ["summary-oob", "details-oob", "replicas-oob", "history-oob"]


@require_GET
@login_required
def model_page(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return render(request, "console/model.html", model_context(request, get_model(name)))


def model_context(
    request: HttpRequest,
    model: Model,
    *,
    bound: dict[str, forms.ConsoleForm] | None = None,
    done: dict[str, str] | None = None,
    refusal: str = "",
) -> dict[str, Any]:
    row = console_selectors.model_rows([model], request.user)[0]
    return {
        "model": model,
        "row": row,
        "view": row.view,
        "registry": row.registry,
        "target": console_selectors.model_target(model),
        "definition_yaml": yaml.safe_dump(
            model.definition(), sort_keys=False, allow_unicode=True, width=1000
        ),
        "audit": console_selectors.audit_rows(
            list(catalog_selectors.audit_queryset(model=model.name)[:20])
        ),
        "forms": {**blank_forms(model), **(bound or {})},
        "done": done or {},
        "refusal": refusal,
        "can_change": row.can_change,
        "config_path": current_config().path,
        "registry_details": console_selectors.registry_details(model),
        "canary": canary_view(model),
        "traffic": console_traffic.model_traffic(model.name, console_traffic.window_named("hour")),
        "queue": queue_context(model.name, console_traffic.window_named("hour")),
        # What the registry part says after a button in it: set by model_registry's views.
        "registry_done": "",
        "registry_warning": "",
        "registry_error": "",
    }


def blank_forms(model: Model) -> dict[str, forms.ConsoleForm]:
    first = model.profiles[0] if model.profiles else {}
    return {
        "scale": forms.ScaleForm(
            model=model,
            initial={
                "min": model.min_replicas,
                "max": model.max_replicas,
                "idle_timeout": format_duration(model.idle_timeout) if model.idle_timeout else "",
            },
        ),
        "resources": forms.ResourcesForm(
            model=model,
            initial={"memory_gb": first.get("memory_gb"), "cores": first.get("cores")},
        ),
        "class": forms.ClassForm(model=model, initial={"class": model.model_class or "default"}),
        "autoscale": forms.AutoscaleForm(
            model=model,
            initial={k: format_duration(v) for k, v in (model.autoscale or {}).items()},
        ),
        "owner": forms.OwnerForm(model=model),
        "adapters": forms.AdaptersForm(model=model),
    }


# -- the forms ------------------------------------------------------------------------


@require_POST
@login_required
def model_scale(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """How many replicas run: min, max, and for an on-demand model the idle timeout."""
    return _change(request, name, forms.ScaleForm, services.model_scale, _scale_done)


def _scale_done(model: Model) -> str:
    if model.parked:
        scaling = "kept in the catalog, not running (min 0, max 0)"
    elif model.on_demand:
        idle = format_duration(model.idle_timeout_in_force(current_config().default_idle_timeout))
        scaling = f"on demand, up to {model.effective_max} (idle timeout {idle})"
    else:
        follows = ", follows min" if model.max_replicas is None else ""
        scaling = f"{model.min_replicas} replicas (max {model.effective_max}{follows})"
    return f"Scale in force: {scaling}."


@require_POST
@login_required
def model_resources(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """What a replica reserves of its node, for one profile or all; replicas are replaced to take it."""
    return _change(
        request, name, forms.ResourcesForm, services.model_set_resources, _resources_done
    )


def _resources_done(model: Model) -> str:
    profiles = "; ".join(
        f"{p['name']}: {p['memory_gb']} GB, {p.get('cores', 0)} cores" for p in model.profiles
    )
    return (
        f"Each replica now reserves {profiles}. "
        "Running replicas are replaced one at a time to take it."
    )


@require_POST
@login_required
def model_autoscale(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The autoscale policy: the queue wait the model is held under, between its min and max."""
    return _change(request, name, forms.AutoscaleForm, services.model_autoscale, _autoscale_done)


def _autoscale_done(model: Model) -> str:
    if not model.autoscale:
        return f"Autoscaling off: {model.name} runs its min ({model.min_replicas})."
    policy = {k: format_duration(v) for k, v in model.autoscale.items()}
    return (
        f"Autoscaling on: between {max(model.min_replicas, 1)} and {model.effective_max} "
        f"replicas, keeping the queue wait under {policy['wait']} (up after "
        f"{policy['up_after']}, down after {policy['down_after']})."
    )


@require_POST
@login_required
def model_class(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The model's class: who gives way to whom when the fleet is full."""
    return _change(request, name, forms.ClassForm, services.model_set_class, _class_done)


def _class_done(model: Model) -> str:
    default = "" if model.model_class else " (the default)"
    return f"Class in force: {model.class_in_force}{default}."


@require_POST
@login_required
def model_owner(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Hand the model to another user; only they and staff may change it afterwards.

    Whether a username exists is told only to those who may change the model.
    """
    return _change(request, name, forms.OwnerForm, services.model_set_owner, _owner_done)


def _owner_done(model: Model) -> str:
    return f"{model.name} now belongs to {model.owner.username if model.owner else 'nobody'}."


@require_POST
@login_required
def model_adapters(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Add a LoRA adapter, or remove some; the source of a new one is checked unless skipped."""
    return _change(request, name, forms.AdaptersForm, services.model_set_adapters, _adapters_done)


def _adapters_done(model: Model) -> str:
    names = ", ".join(a["name"] for a in model.adapters) or "none"
    return f"Adapters in force: {names}."


def _change(
    request: HtmxHttpRequest,
    name: str,
    form_class: type[forms.ChangeForm],
    write: Callable[..., Model],
    done: Callable[[Model], str],
) -> HttpResponse:
    """One form of the model page: `write` (the service) takes its values, `done` says what
    is now in force. A form that does not validate, or that the service refuses, comes back
    with the refusal in it (400, or the service's status).
    """
    model = get_model(name)
    form = form_class(request.POST, model=model)
    what = form.what
    status = 400
    if form.is_valid():
        try:
            changed = write(actor=actor(request), name=model.name, **form.arguments())
        except Refused as error:
            form.refuse(error)
            status = error.status
        else:
            return _done(request, changed, what, done(get_model(changed.name)))
    if wants_partial(request):
        context = model_context(request, model, bound={what: form})
        return render_partials(request, "console/model.html", [f"{what}-form"], context, status)
    context = model_context(request, model, bound={what: form}, refusal=_first_error(form))
    return render(request, "console/model.html", context, status=status)


def _first_error(form: forms.ConsoleForm) -> str:
    errors = form.non_field_errors()
    return str(errors[0]) if errors else "The change was not made: see the form below."


# -- the buttons ----------------------------------------------------------------------


@require_POST
@login_required
def model_restart(request: HtmxHttpRequest, name: str) -> HttpResponse:
    model = get_model(name)
    try:
        model = services.model_restart(actor=actor(request), name=model.name)
    except Refused as error:
        return _refused(request, model, "restart", error)
    text = (
        f"Rolling restart of {model.name} asked for (generation {model.generation}): "
        "each replica is replaced in turn, a ready one always serving."
    )
    return _done(request, model, "restart", text)


@require_POST
@login_required
def model_remove(request: HtmxHttpRequest, name: str) -> HttpResponse:
    model = get_model(name)
    try:
        services.model_remove(actor=actor(request), name=model.name)
    except Refused as error:
        return _refused(request, model, "remove", error)
    messages.success(request, f"{model.name} was removed from the catalog; its replicas stop.")
    if request.htmx:
        return HttpResponseClientRedirect(reverse("console-models"))
    return HttpResponseRedirect(reverse("console-models"))


def _refused(request: HtmxHttpRequest, model: Model, what: str, error: Refused) -> HttpResponse:
    """A refused button (restart, remove): the service's message beside it."""
    if wants_partial(request):
        context = {**model_context(request, model), "errors": {what: error.message}}
        return render_partials(
            request, "console/model.html", [f"{what}-form"], context, error.status
        )
    context = model_context(request, model, refusal=error.message)
    return render(request, "console/model.html", context, status=error.status)


def _done(request: HtmxHttpRequest, model: Model, what: str, text: str) -> HttpResponse:
    """A change made: the message and the refreshed page, or for htmx the parts it touched."""
    if not wants_partial(request):
        messages.success(request, text)
        return HttpResponseRedirect(reverse("console-model", args=[model.name]))
    context = model_context(request, get_model(model.name), done={what: text})
    return render_partials(
        request, "console/model.html", [f"{what}-form", *REFRESHED], context, 200
    )


# -- traffic --------------------------------------------------------------------------


@require_GET
@login_required
def model_traffic(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The traffic part of a model's page, for another window (htmx) or on its own."""
    model = get_model(name)
    window = console_traffic.window_named(request.GET.get("window", ""))
    context = {
        "model": model,
        "traffic": console_traffic.model_traffic(model.name, window),
        "queue": queue_context(model.name, window),
    }
    return render(request, "console/_traffic.html", context)


def queue_context(name: str, window: traffic.Window) -> dict[str, Any]:
    """The fair queue beside the traffic charts: the requests waiting for a free slot now (in
    this machine's gateway processes), and those that waited over the charts' window."""
    return {
        "waiting_now": live.waiting_now([name])[name],
        "total": traffic.queue_totals(name, window),
    }

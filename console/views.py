"""The console's pages and actions.

Views stay thin: they read through selectors, write through the catalog and
fleet services with the console as the door, and show a service's refusal as
it is worded. One template holds each page and its partials: an htmx request
gets the partial it asked for, any other request the whole page, so every
page and form also works without JavaScript.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any
from urllib.parse import urlencode

import yaml
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseClientRedirect
from django_htmx.middleware import HtmxDetails

from catalog import selectors as catalog_selectors
from catalog import services, updates
from catalog.config import current_config
from catalog.definitions import clean_definition
from catalog.durations import format_duration
from catalog.errors import CatalogError, Problem, forbidden
from catalog.models import Fetch, Model
from catalog.services import Actor
from catalog.yamltext import YAMLSyntaxError, line_for, load_with_lines
from fleet import selectors as fleet_selectors
from fleet import services as fleet_services

from . import forms
from . import selectors as console_selectors
from . import traffic as console_traffic


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


View = Callable[..., HttpResponse]


def login_required(view: View) -> View:
    """Every page needs a login; an htmx request whose session ended reloads to the login page."""

    @wraps(view)
    def wrapper(request: HtmxHttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.user.is_authenticated:
            return view(request, *args, **kwargs)
        if request.htmx:
            page = request.htmx.current_url_abs_path or request.get_full_path()
            return HttpResponseClientRedirect(f"{settings.LOGIN_URL}?{urlencode({'next': page})}")
        return redirect_to_login(request.get_full_path())

    return wrapper


def actor(request: HttpRequest) -> Actor:
    return Actor.for_user(request.user, "console")


def wants_partial(request: HtmxHttpRequest) -> bool:
    # A history restore asks for the whole page: htmx puts it in place of the body.
    return bool(request.htmx) and not request.htmx.history_restore_request


def render_page(
    request: HtmxHttpRequest,
    template: str,
    partial: str,
    context: dict[str, Any],
    status: int = 200,
) -> HttpResponse:
    name = f"{template}#{partial}" if wants_partial(request) else template
    response = render(request, template_name=name, context=context, status=status)
    patch_vary_headers(response, ("HX-Request",))
    return response


def render_partials(
    request: HttpRequest, template: str, partials: list[str], context: dict[str, Any], status: int
) -> HttpResponse:
    """Several partials in one htmx answer: the first swaps its target, the rest out of band."""
    parts = [render_to_string(f"{template}#{name}", context, request) for name in partials]
    return HttpResponse("".join(parts), status=status)


def get_model(name: str) -> Model:
    try:
        return catalog_selectors.model_queryset().get(name=name)
    except Model.DoesNotExist:
        raise Http404(f"There is no model named {name!r}.") from None


def query_without_page(request: HttpRequest) -> str:
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode()


# -- models -------------------------------------------------------------------------


@require_GET
@login_required
def models_page(request: HtmxHttpRequest) -> HttpResponse:
    filters = {
        "owner": request.GET.get("owner", "").strip(),
        "klass": request.GET.get("class", "").strip(),
        "state": request.GET.get("state", "").strip(),
        "search": request.GET.get("q", "").strip(),
    }
    page = console_selectors.page_of(
        console_selectors.filter_models(**filters),
        request.GET.get("page"),
        console_selectors.MODELS_PER_PAGE,
    )
    rows = console_selectors.model_rows(list(page.object_list), request.user)
    lines = console_traffic.sparklines([row.view["name"] for row in rows])
    for row in rows:
        row.traffic = lines[row.view["name"]]
    context = {
        "page": page,
        "rows": rows,
        "filters": filters,
        "filtered": any(filters.values()),
        "owners": console_selectors.owners(),
        "classes": console_selectors.CLASSES,
        "states": console_selectors.STATES,
        "query": query_without_page(request),
    }
    return render_page(request, "console/models.html", "models-table", context)


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
        "traffic": console_traffic.model_traffic(model.name, console_traffic.window_named("hour")),
        # What the registry part says after a button in it: set by _registry_answer.
        "registry_done": "",
        "registry_warning": "",
        "registry_error": "",
    }


def blank_forms(model: Model) -> dict[str, forms.ConsoleForm]:
    first = model.profiles[0] if model.profiles else {}
    return {
        "scale": forms.ScaleForm(
            auto_id="scale-%s",
            initial={
                "min": model.min_replicas,
                "max": model.max_replicas,
                "idle_timeout": format_duration(model.idle_timeout) if model.idle_timeout else "",
            },
        ),
        "resources": forms.ResourcesForm(
            model=model,
            auto_id="resources-%s",
            initial={"memory_gb": first.get("memory_gb"), "cores": first.get("cores")},
        ),
        "class": forms.ClassForm(
            auto_id="class-%s", initial={"class": model.model_class or "default"}
        ),
        "owner": forms.OwnerForm(auto_id="owner-%s"),
        "adapters": forms.AdaptersForm(model=model, auto_id="adapters-%s"),
    }


@require_GET
@login_required
def model_page(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return render(request, "console/model.html", model_context(request, get_model(name)))


@dataclass(frozen=True)
class Change:
    """One of the model page's forms: how to call its service and what to say once it is done."""

    form: Callable[..., forms.ConsoleForm]
    apply: Callable[[Actor, str, dict[str, Any]], Model]
    done: Callable[[Model], str]


def _scaling_text(model: Model) -> str:
    if model.parked:
        return "kept in the catalog, not running (min 0, max 0)"
    if model.on_demand:
        idle = format_duration(model.idle_timeout_in_force(current_config().default_idle_timeout))
        return f"on demand, up to {model.effective_max} (idle timeout {idle})"
    follows = ", follows min" if model.max_replicas is None else ""
    return f"{model.min_replicas} replicas (max {model.effective_max}{follows})"


def _profiles_text(model: Model) -> str:
    return "; ".join(
        f"{p['name']}: {p['memory_gb']} GB, {p.get('cores', 0)} cores" for p in model.profiles
    )


CHANGES: dict[str, Change] = {
    "scale": Change(
        form=forms.ScaleForm,
        apply=lambda who, name, data: services.model_scale(
            actor=who,
            name=name,
            min_replicas=data["min"],
            max_replicas=data["max"],
            idle_timeout=data["idle_timeout"],
        ),
        done=lambda model: f"Scale in force: {_scaling_text(model)}.",
    ),
    "resources": Change(
        form=forms.ResourcesForm,
        apply=lambda who, name, data: services.model_set_resources(
            actor=who,
            name=name,
            memory_gb=data["memory_gb"],
            cores=data["cores"],
            profile=data["profile"] or None,
        ),
        done=lambda model: (
            f"Each replica now reserves {_profiles_text(model)}. "
            "Running replicas are replaced one at a time to take it."
        ),
    ),
    "class": Change(
        form=forms.ClassForm,
        apply=lambda who, name, data: services.model_set_class(
            actor=who, name=name, klass=data["class"]
        ),
        done=lambda model: (
            f"Class in force: {model.class_in_force}"
            + ("" if model.model_class else " (the default)")
            + "."
        ),
    ),
    "owner": Change(
        form=forms.OwnerForm,
        apply=lambda who, name, data: services.model_set_owner(
            actor=who, name=name, username=data["owner"].strip()
        ),
        done=lambda model: (
            f"{model.name} now belongs to {model.owner.username if model.owner else 'nobody'}."
        ),
    ),
    "adapters": Change(
        form=forms.AdaptersForm,
        apply=lambda who, name, data: services.model_set_adapters(
            actor=who,
            name=name,
            add=data["add"],
            remove=list(data.get("remove") or []),
            source_check=not data["skip_source_check"],
        ),
        done=lambda model: (
            "Adapters in force: " + (", ".join(a["name"] for a in model.adapters) or "none") + "."
        ),
    ),
}

# What an htmx answer to a change also refreshes, out of band.
REFRESHED = ["summary-oob", "details-oob", "replicas-oob", "history-oob"]


def _change_view(request: HtmxHttpRequest, name: str, what: str) -> HttpResponse:
    change = CHANGES[what]
    model = get_model(name)
    extra = {"model": model} if what in ("resources", "adapters") else {}
    form = change.form(request.POST, auto_id=f"{what}-%s", **extra)
    status = 400
    if form.is_valid():
        try:
            model = change.apply(actor(request), model.name, form.cleaned_data)
        except CatalogError as error:
            form.refuse(error)
            status = error.status
        else:
            text = change.done(get_model(model.name))
            if not wants_partial(request):
                messages.success(request, text)
                return HttpResponseRedirect(reverse("console-model", args=[model.name]))
            context = model_context(request, get_model(model.name), done={what: text})
            return render_partials(
                request, "console/model.html", [f"{what}-form", *REFRESHED], context, 200
            )
    if wants_partial(request):
        context = model_context(request, model, bound={what: form})
        return render_partials(request, "console/model.html", [f"{what}-form"], context, status)
    context = model_context(request, model, bound={what: form}, refusal=_first_error(form))
    return render(request, "console/model.html", context, status=status)


def _first_error(form: forms.ConsoleForm) -> str:
    errors = form.non_field_errors()
    return str(errors[0]) if errors else "The change was not made: see the form below."


def _change(what: str) -> View:
    @require_POST
    @login_required
    def view(request: HtmxHttpRequest, name: str) -> HttpResponse:
        return _change_view(request, name, what)

    view.__name__ = f"model_{what}"
    return view


model_scale = _change("scale")
model_resources = _change("resources")
model_class = _change("class")
model_owner = _change("owner")
model_adapters = _change("adapters")


@require_POST
@login_required
def model_restart(request: HtmxHttpRequest, name: str) -> HttpResponse:
    model = get_model(name)
    try:
        model = services.model_restart(actor=actor(request), name=model.name)
    except CatalogError as error:
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
    except CatalogError as error:
        return _refused(request, model, "remove", error)
    messages.success(request, f"{model.name} was removed from the catalog; its replicas stop.")
    if request.htmx:
        return HttpResponseClientRedirect(reverse("console-models"))
    return HttpResponseRedirect(reverse("console-models"))


def _refused(
    request: HtmxHttpRequest, model: Model, what: str, error: CatalogError
) -> HttpResponse:
    """A refused button (restart, remove, update, rollback): the service's message beside it."""
    if wants_partial(request):
        context = {**model_context(request, model), "errors": {what: error.message}}
        return render_partials(
            request, "console/model.html", [f"{what}-form"], context, error.status
        )
    context = model_context(request, model, refusal=error.message)
    return render(request, "console/model.html", context, status=error.status)


def _done(request: HtmxHttpRequest, model: Model, what: str, text: str) -> HttpResponse:
    if not wants_partial(request):
        messages.success(request, text)
        return HttpResponseRedirect(reverse("console-model", args=[model.name]))
    context = model_context(request, get_model(model.name), done={what: text})
    return render_partials(
        request, "console/model.html", [f"{what}-form", *REFRESHED], context, 200
    )


# -- registry updates ---------------------------------------------------------------

# What the model page's poll of its registry part also refreshes, out of band: a
# rollout changes the source, the replicas and the history while it runs.
REFRESHED_BY_ROLLOUT = ["summary-oob", "replicas-oob", "history-oob"]


def _registry_answer(
    request: HtmxHttpRequest,
    model: Model,
    *,
    done: str = "",
    warning: str = "",
    error: CatalogError | None = None,
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
            "row": console_selectors.model_rows([model], request.user)[0],
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
    start = updates.start_update if what == "update" else updates.start_rollback
    try:
        rollout = start(actor=actor(request), name=model.name)
    except CatalogError as error:
        return _registry_answer(request, model, error=error)
    before, after = rollout.from_commit[:7] or "?", rollout.to_commit[:7] or "?"
    done = (
        f"Update of {model.name} started ({before} → {after}): the new files are fetched and "
        "checked, then replicas are replaced one at a time."
        if what == "update"
        else f"Rollback of {model.name} started ({before} → {after}): replicas go back to the "
        "previous files, one at a time."
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
    if not console_selectors.can_change(request.user, model):
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


# -- add a model ----------------------------------------------------------------------


def _path_of(field: str, name: str) -> tuple[str | int, ...]:
    """A problem's field ("tiny.fallbacks[0]") as a path into the definition ("fallbacks", 0)."""
    if name and field.startswith(f"{name}."):
        field = field[len(name) + 1 :]
    path: list[str | int] = []
    for part in field.replace("[", ".[").split("."):
        if part.startswith("[") and part.endswith("]") and part[1:-1].isdigit():
            path.append(int(part[1:-1]))
        elif part:
            path.append(part)
    return tuple(path)


def _placed(problems: list[Problem], lines: dict[Any, int], name: str) -> list[Problem]:
    """Problems with the line each is about, for those the whole-catalog checks found."""
    return [
        p
        if p.line is not None or not lines
        else Problem(p.field, p.message, line_for(lines, _path_of(p.field, name)))
        for p in problems
    ]


def annotated_lines(text: str, problems: list[Problem]) -> list[dict[str, Any]]:
    """The pasted YAML, line by line, each with the problems that point at it."""
    by_line: dict[int, list[Problem]] = {}
    for problem in problems:
        if problem.line is not None:
            by_line.setdefault(problem.line, []).append(problem)
    return [
        {"number": number, "text": line, "problems": by_line.get(number, [])}
        for number, line in enumerate(text.splitlines() or [""], start=1)
    ]


def add_context(
    *, form: forms.AddModelForm | None = None, serve_form: forms.ServeForm | None = None
) -> dict[str, Any]:
    return {
        "form": form
        or forms.AddModelForm(auto_id="add-%s", initial={"definition": EXAMPLE_DEFINITION}),
        "serve_form": serve_form or forms.ServeForm(auto_id="serve-%s"),
        "registry_endpoint": current_config().registry_endpoint,
    }


@require_GET
@login_required
def add_page(request: HtmxHttpRequest) -> HttpResponse:
    return render(request, "console/add.html", add_context())


EXAMPLE_DEFINITION = """\
name: my-model
source: http://127.0.0.1:8000/mirror/ORG/REPO/COMMIT/FILE.gguf
description: what it is for
min_replicas: 1
profiles:
  - {name: cpu, memory_gb: 2, cores: 2}
"""


@require_POST
@login_required
def add_model(request: HtmxHttpRequest) -> HttpResponse:
    form = forms.AddModelForm(request.POST, auto_id="add-%s")
    problems: list[Problem] = []
    status = 400
    if form.is_valid():
        text = form.cleaned_data["definition"]
        lines: dict[Any, int] = {}
        name = ""
        try:
            try:
                data, lines = load_with_lines(text)
            except YAMLSyntaxError as exc:
                raise CatalogError(
                    f"The definition is not valid YAML: {exc}.",
                    code="parse_error",
                    problems=[Problem("", str(exc), exc.line)],
                ) from None
            if isinstance(data, dict) and isinstance(data.get("name"), str):
                name = data["name"]
            definition = clean_definition(data, lines=lines)
            model = services.model_add(
                actor=actor(request),
                definition=definition,
                source_check=not form.cleaned_data["skip_source_check"],
            )
        except CatalogError as error:
            form.add_error(None, error.message)
            problems = _placed(error.problems, lines, name)
            status = error.status
        else:
            messages.success(
                request,
                f"{model.name} was added, owned by {model.owner.username if model.owner else 'nobody'}; "
                f"the fleet places its replicas next.",
            )
            url = reverse("console-model", args=[model.name])
            if request.htmx:
                return HttpResponseClientRedirect(url)
            return HttpResponseRedirect(url)
    text = form.data.get("definition", "")
    context = {
        **add_context(form=form),
        "lines": annotated_lines(text, problems) if problems else [],
        "unplaced": [p for p in problems if p.line is None],
    }
    return render_page(request, "console/add.html", "add-form", context, status=status)


# -- serve from the registry ----------------------------------------------------------


@require_POST
@login_required
def serve_model(request: HtmxHttpRequest) -> HttpResponse:
    """Start fetching a repository's GGUF file; the answer follows the fetch until the model is in."""
    form = forms.ServeForm(request.POST, auto_id="serve-%s")
    status = 400
    if form.is_valid():
        serve = form.cleaned_data["serve"]
        try:
            fetch = updates.serve_start(
                actor=actor(request),
                repo=serve["repo"],
                pattern=serve["file"],
                branch=serve["revision"],
                name=serve.get("name"),
                memory_gb=serve.get("memory_gb"),
                cores=serve.get("cores"),
                min_replicas=serve["min"],
                max_replicas=serve.get("max"),
            )
        except CatalogError as error:
            form.refuse(error)
            status = error.status
        else:
            url = reverse("console-fetch", args=[fetch.pk])
            if not wants_partial(request):
                return HttpResponseRedirect(url)
            # The fetch takes the form's place; the address becomes the fetch's page,
            # so that a reload keeps following it.
            context = console_selectors.fetch_progress(fetch)
            response = render(request, "console/fetch.html#fetch-progress", context)
            response["HX-Push-Url"] = url
            return response
    if wants_partial(request) and status not in (400, 403, 409):
        # A registry that cannot be reached is a 502; htmx swaps only 2xx and 400/403/409
        # answers, and the form with the registry's message in it is what helps here.
        status = 400
    context = add_context(serve_form=form)
    return render_page(request, "console/add.html", "serve-form", context, status=status)


@require_GET
@login_required
def fetch_page(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """A fetch into the mirror and its progress: the whole page, or for htmx's poll the card."""
    fetch = Fetch.objects.filter(pk=pk).first()
    if fetch is None:
        raise Http404(f"There is no fetch {pk}.")
    context = console_selectors.fetch_progress(fetch)
    return render_page(request, "console/fetch.html", "fetch-progress", context)


# -- nodes --------------------------------------------------------------------------


@require_GET
@login_required
def nodes_page(request: HtmxHttpRequest) -> HttpResponse:
    cards = console_selectors.node_cards(
        fleet_selectors.nodes_view(addresses=request.user.is_staff)
    )
    context = {"nodes": cards, "capacity": console_traffic.capacity_chart()}
    return render(request, "console/nodes.html", context)


def _cordon_view(request: HtmxHttpRequest, name: str, cordoned: bool) -> HttpResponse:
    error: CatalogError | None = None
    try:
        node = fleet_services.node_cordon(actor=actor(request), name=name, cordoned=cordoned)
    except CatalogError as exc:
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


@require_POST
@login_required
def node_cordon(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _cordon_view(request, name, True)


@require_POST
@login_required
def node_uncordon(request: HtmxHttpRequest, name: str) -> HttpResponse:
    return _cordon_view(request, name, False)


# -- audit --------------------------------------------------------------------------


@require_GET
@login_required
def audit_page(request: HtmxHttpRequest) -> HttpResponse:
    filters = {
        "model": request.GET.get("model", "").strip(),
        "actor": request.GET.get("actor", "").strip(),
        "action": request.GET.get("action", "").strip(),
    }
    entries = catalog_selectors.audit_queryset(**{k: v or None for k, v in filters.items()})
    page = console_selectors.page_of(
        entries, request.GET.get("page"), console_selectors.AUDIT_PER_PAGE
    )
    context = {
        "page": page,
        "entries": console_selectors.audit_rows(list(page.object_list)),
        "filters": filters,
        "filtered": any(filters.values()),
        "actions": console_selectors.audit_actions(),
        "query": query_without_page(request),
    }
    return render_page(request, "console/audit.html", "audit-table", context)


# -- traffic and usage ---------------------------------------------------------------------


@require_GET
@login_required
def model_traffic(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The traffic part of a model's page, for another window (htmx) or on its own."""
    model = get_model(name)
    window = console_traffic.window_named(request.GET.get("window", ""))
    context = {"model": model, "traffic": console_traffic.model_traffic(model.name, window)}
    return render(request, "console/_traffic.html", context)


@require_GET
@login_required
def usage_page(request: HtmxHttpRequest) -> HttpResponse:
    context = console_traffic.usage_context(actor(request), request.GET.dict())
    return render_page(request, "console/usage.html", "usage-table", context)

"""The add page: paste a model's definition, or serve a file from the registry.

A definition the catalog refuses comes back with each problem beside the line it is
about; serving starts a fetch, and the answer follows the fetch until the model is in.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseClientRedirect

from catalog import services
from catalog.config import current_config
from catalog.definitions import clean_definition, load_definition_text
from console import forms
from console import selectors as console_selectors
from core.refusals import Problem, Refused
from core.yamltext import line_for
from registry import updates

from .pages import HtmxHttpRequest, actor, login_required, render_page, wants_partial

EXAMPLE_DEFINITION = """\
name: my-model
source: http://127.0.0.1:8000/mirror/ORG/REPO/COMMIT/FILE.gguf
description: what it is for
min_replicas: 1
profiles:
  - {name: cpu, memory_gb: 2, cores: 2}
"""


@require_GET
@login_required
def add_page(request: HtmxHttpRequest) -> HttpResponse:
    return render(request, "console/add.html", add_context())


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
            data, lines = load_definition_text(text)
            if isinstance(data, dict) and isinstance(data.get("name"), str):
                name = data["name"]
            definition = clean_definition(data, lines=lines)
            model = services.model_add(
                actor=actor(request),
                definition=definition,
                source_check=not form.cleaned_data["skip_source_check"],
            )
        except Refused as error:
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
            fetch = updates.serve_start(actor=actor(request), **serve)
        except Refused as error:
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

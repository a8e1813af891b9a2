"""What every console page shares: the login check, the door, and rendering a page or its partial."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils.cache import patch_vary_headers
from django_htmx.http import HttpResponseClientRedirect
from django_htmx.middleware import HtmxDetails

from catalog import services
from catalog.models import Model
from core.actor import Actor
from core.refusals import Refused


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
    """The model, or the console's 404 page with the services' words (and their did-you-mean)."""
    try:
        return services.get_model(name)
    except Refused as error:
        raise Http404(error.message) from None


def filters_of(request: HttpRequest, **parameters: str) -> dict[str, str]:
    """A list page's filters from its query: each name from its query parameter, trimmed."""
    return {name: request.GET.get(parameter, "").strip() for name, parameter in parameters.items()}


def query_without_page(request: HttpRequest) -> str:
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode()

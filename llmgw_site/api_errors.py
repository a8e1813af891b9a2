"""One error shape for the whole API: {"detail": sentence, "code": stable code, "problems": [...]}."""

from __future__ import annotations

import sys
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from core import diskspace
from core.refusals import Problem, Refused, invalid
from core.serializers import flatten_errors, path_text


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, Refused):
        return Response(exc.as_dict(), status=exc.status)
    full = diskspace.disk_full(exc)
    if full is not None:
        refusal = diskspace.refusal(full)
        return Response(
            refusal.as_dict(),
            status=refusal.status,
            headers={"Retry-After": str(diskspace.RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, RequestDataTooBig):
        return Response(
            {
                "detail": "The request body is too large; a model definition is a few kilobytes.",
                "code": "too_large",
            },
            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
        )
    if isinstance(exc, exceptions.ValidationError):
        # The sentence is core.refusals.invalid's, as every other door's refusal: DRF's messages
        # end with a period of their own ("This field may not be blank."), which it drops before
        # ending the sentence once (this copy had said "blank..").
        problems = [
            Problem(path_text(path), message) for path, message in flatten_errors(exc.detail)
        ]
        refusal = invalid(problems, what="The request")
        return Response(
            {
                "detail": refusal.message,
                "code": refusal.code,
                "problems": [p.as_dict() for p in problems],
            },
            status=status.HTTP_400_BAD_REQUEST,
        )
    if isinstance(exc, Http404):
        # Raised by Django or DRF itself (say ?format= naming a format the endpoint lacks).
        exc = exceptions.NotFound(
            str(exc) or "Not found: nothing here by that path (or in the ?format= asked for)."
        )
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(exc, exceptions.APIException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        body: dict[str, Any] = {"detail": _sentence(detail, exc), "code": _code(exc)}
        line = getattr(exc, "line", None)
        if line is not None:
            body["line"] = line
        response.data = body
    return response


def _code(exc: exceptions.APIException) -> str:
    codes = exc.get_codes()
    return codes if isinstance(codes, str) else exc.default_code


def _sentence(detail: str, exc: exceptions.APIException) -> str:
    if isinstance(exc, exceptions.NotAuthenticated):
        return (
            "Log in first: send an API token as 'Authorization: Token KEY' (llmgw ctl reads "
            "LLMGW_TOKEN, else the token `llmgw ctl login` kept)."
        )
    if isinstance(exc, exceptions.AuthenticationFailed):
        return (
            f"{detail} Check LLMGW_TOKEN (a disabled account's tokens stop working); the run "
            "command prints one the first time, and `manage.py llmgw_token USER` issues another."
        )
    return detail


# -- outside DRF: unknown endpoints and unexpected errors ---------------------------------


@csrf_exempt  # nothing to protect, and a POST must get this answer rather than a CSRF page
def no_such_endpoint(request: HttpRequest) -> JsonResponse:
    return JsonResponse(
        {
            "detail": f"There is no API endpoint {request.path}; the endpoints are listed at "
            "/api/v1/docs (and /api/v1/schema).",
            "code": "not_found",
        },
        status=status.HTTP_404_NOT_FOUND,
    )


def server_error(request: HttpRequest) -> HttpResponse:
    """An unexpected error: the API answers in its JSON shape, pages with Django's page. A
    write that met a full disk (outside DRF's views: the console, the admin, a session being
    saved) is no unexpected error: it is answered as the API answers it (disk_full_answer)."""
    full = diskspace.disk_full(sys.exc_info()[1])
    if full is not None:
        return disk_full_answer(request, full)
    if request.path.startswith("/api/"):
        return JsonResponse(
            {
                "detail": "The server failed on this request; the error is in the web process's "
                "log. Try again, and report it if it keeps failing.",
                "code": "server_error",
            },
            status=status.HTTP_500_INTERNAL_SERVER_ERROR,
        )
    return defaults.server_error(request)


def disk_full_answer(request: HttpRequest, full: BaseException) -> HttpResponse:
    """507 Insufficient Storage with the sentence of core.diskspace.refusal and a Retry-After:
    JSON for the API, the sentence alone for the console's htmx requests (console.js shows
    it), a page for the rest."""
    refusal = diskspace.refusal(full)
    response: HttpResponse
    if request.path.startswith("/api/"):
        response = JsonResponse(refusal.as_dict(), status=refusal.status)
    elif request.headers.get("HX-Request") == "true":
        response = HttpResponse(
            refusal.message, status=refusal.status, content_type="text/plain; charset=utf-8"
        )
    else:
        response = HttpResponse(
            render_to_string("llmgw_site/disk_full.html", {"message": refusal.message}),
            status=refusal.status,
        )
    response["Retry-After"] = str(diskspace.RETRY_AFTER_SECONDS)
    return response


class DiskFullMiddleware:
    """A view's write that met a full disk answered by disk_full_answer, before Django's
    handler would log it with its traceback as an unexpected error (DRF's views answer it in
    exception_handler; server_error still answers what fails outside a view)."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        full = diskspace.disk_full(exc)
        return None if full is None else disk_full_answer(request, full)

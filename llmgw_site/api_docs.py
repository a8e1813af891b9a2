"""The API's schema and docs page, for those logged in unless LLMGW_PUBLIC_API_DOCS=true.

The rest of /api/v1/ answers nobody anonymous; the schema, a map of every operation and its
fields, did until this. A console session or an API token opens both; an anonymous request gets
401 with a sentence that says how to log in, and which setting opens them to everyone (a public
demo, say). The docs page answers a browser with a small page that links to the login, since
its JSON error would be rendered as a bare "401 Unauthorized" by the page's HTML renderer.
"""

from __future__ import annotations

from typing import Any, NoReturn

from django.conf import settings
from django.http import HttpResponse
from django.utils.html import format_html
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework import exceptions, status
from rest_framework.permissions import BasePermission
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

LOGIN_NEEDED = (
    "The API schema and docs are for logged-in users: log in to the console at /login/ and "
    "open /api/v1/docs, or send an API token as 'Authorization: Bearer KEY' (the run command "
    "prints one the first time; `manage.py llmgw_token USER` issues another). "
    "LLMGW_PUBLIC_API_DOCS=true opens them to everyone."
)


class DocsNeedLogin(exceptions.APIException):
    """401 with its own sentence: DRF's NotAuthenticated would be given the API's general one."""

    status_code = status.HTTP_401_UNAUTHORIZED
    default_detail = LOGIN_NEEDED
    default_code = "not_authenticated"
    # DRF's exception handler sends it as WWW-Authenticate, as a 401 must have.
    auth_header = "Token"


class DocsReaders(BasePermission):
    """Anyone logged in, or everyone when LLMGW_PUBLIC_API_DOCS is true (read per request)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if settings.LLMGW_PUBLIC_API_DOCS:
            return True
        return bool(request.user and request.user.is_authenticated)


class LoginToRead(APIView):
    """For the views below: DocsReaders only, and their refusal says how to log in."""

    permission_classes = [DocsReaders]

    def permission_denied(
        self, request: Request, message: Any = None, code: Any = None
    ) -> NoReturn:
        raise DocsNeedLogin()


class SchemaView(LoginToRead, SpectacularAPIView):
    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        # A refusal in the API's JSON shape, not in the schema's YAML renderer.
        if getattr(response, "exception", False):
            request.accepted_renderer = JSONRenderer()
            request.accepted_media_type = JSONRenderer.media_type
        return super().finalize_response(request, response, *args, **kwargs)


class DocsView(LoginToRead, SpectacularSwaggerView):
    def handle_exception(self, exc: Exception) -> Any:
        if isinstance(exc, DocsNeedLogin):
            page = format_html(
                "<!doctype html><title>Log in to read the API docs</title><p>{} "
                '<a href="{}?next=/api/v1/docs">Log in</a></p>',
                LOGIN_NEEDED,
                settings.LOGIN_URL,
            )
            response = HttpResponse(page, status=exc.status_code)
            response["WWW-Authenticate"] = exc.auth_header
            return response
        return super().handle_exception(exc)

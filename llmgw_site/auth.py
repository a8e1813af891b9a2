"""API authentication: `Authorization: Token KEY` or `Authorization: Bearer KEY`.

Tokens are kept only as hashes (accounts.ApiToken); a wrong token is refused with 401.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from accounts.services import token_user


def credential_of(header: str) -> str | None:
    """The token in an Authorization header of either scheme, or None."""
    keyword, _, credential = header.partition(" ")
    if keyword.lower() not in ("token", "bearer"):
        return None
    return credential.strip() or None


class TokenOrBearerAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Any, str] | None:
        secret = credential_of(request.META.get("HTTP_AUTHORIZATION", ""))
        if secret is None:
            return None
        user = token_user(secret)
        if user is None:
            raise AuthenticationFailed("Invalid token.")
        return user, secret

    def authenticate_header(self, request: Request) -> str:
        return "Token"


class TokenScheme(OpenApiAuthenticationExtension):
    target_class = TokenOrBearerAuthentication
    name = "apiToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "an API token (`Authorization: Bearer KEY`, or `Token KEY`); the run "
            "command prints one the first time, `manage.py llmgw_token USER` issues another",
        }

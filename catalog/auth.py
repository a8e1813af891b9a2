"""API authentication: `Authorization: Token KEY` or `Authorization: Bearer KEY`.

Tokens are kept only as hashes (accounts.ApiToken); a wrong token is refused with 401.
"""

from __future__ import annotations

from typing import Any

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

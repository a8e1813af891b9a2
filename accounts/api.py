"""People's own API tokens over the REST API: listed, and revoked one at a time or the one in
use (`llmgw ctl logout`). Making one is the admin's, `manage.py llmgw_token`'s, or
`llmgw ctl login`'s (signin.device)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import answers, out
from core.refusals import Refused
from llmgw.bearer import digest

from . import services
from .models import ApiToken


class TokenOut(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    prefix = serializers.CharField()
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    current = serializers.BooleanField(help_text="the token this request was made with")


def token_items(tokens: list[ApiToken], request: Request) -> list[dict[str, Any]]:
    used = digest(request.auth) if isinstance(request.auth, str) else ""
    return [
        {
            "id": t.pk,
            "name": t.name,
            "prefix": t.prefix,
            "created_at": t.created_at,
            "last_used_at": t.last_used_at,
            "expires_at": t.expires_at,
            "current": t.digest == used,
        }
        for t in tokens
    ]


def _not_yours(token_id: Any) -> Refused:
    return Refused(
        f"You have no API token {token_id}; `GET /api/v1/tokens` lists yours.",
        code="not_found",
        status=404,
    )


class TokensAPI(APIView):
    @extend_schema(
        summary="Your API tokens (never the tokens themselves: their first characters)",
        responses=answers({200: TokenOut(many=True)}),
    )
    def get(self, request: Request) -> Response:
        tokens = services.tokens_of(request.user)
        return Response(out(TokenOut, token_items(tokens, request), many=True))


class TokenAPI(APIView):
    @extend_schema(
        summary="Revoke one of your API tokens (`current`: the one this request is made with); "
        "requests with it get 401 from now on",
        request=None,
        responses=answers({200: TokenOut}, 400, 404),
    )
    def delete(self, request: Request, token_id: str) -> Response:
        user: Any = request.user  # authenticated: a User
        if token_id == "current":
            if not isinstance(request.auth, str):
                raise Refused(
                    "This request was not made with an API token (a browser session has none).",
                    code="no_token",
                )
            token = ApiToken.objects.filter(user=user, digest=digest(request.auth)).first()
        elif token_id.isdigit() and len(token_id) < 19:
            token = ApiToken.objects.filter(user=user, pk=int(token_id)).first()
        else:
            raise _not_yours(token_id)
        if token is None:
            raise _not_yours(token_id)
        body = out(TokenOut, token_items([token], request)[0])
        services.token_revoke(user=request.user, token_id=token.pk)
        return Response(body)

"""Gateway keys in the REST API under /api/v1/keys, for the console and `llmgw ctl`.

Any user creates keys of their own and sees and revokes their own; staff see
and revoke everyone's.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.api import ERROR, actor_of

from . import selectors, services
from .services import KEY_NAME_MAX


def _key_fields() -> dict[str, serializers.Field]:
    return {
        "id": serializers.IntegerField(),
        "name": serializers.CharField(),
        "prefix": serializers.CharField(help_text="the key's first characters"),
        "owner": serializers.CharField(),
        "state": serializers.ChoiceField(choices=["active", "revoked"]),
        "created_at": serializers.DateTimeField(),
        "last_used_at": serializers.DateTimeField(allow_null=True, help_text="to within a minute"),
        "revoked_at": serializers.DateTimeField(allow_null=True),
        "revoked_by": serializers.CharField(allow_null=True),
    }


KEY_VIEW = inline_serializer("GatewayKeyView", _key_fields())
KEY_LIST = inline_serializer("GatewayKeyList", _key_fields(), many=True)
NEW_KEY_VIEW = inline_serializer(
    "NewGatewayKeyView",
    {
        **_key_fields(),
        "key": serializers.CharField(help_text="the key itself: shown only in this answer"),
    },
)


class KeyCreateInput(serializers.Serializer):
    name = serializers.CharField(
        max_length=KEY_NAME_MAX, help_text="what the key is for, say the application using it"
    )


class KeysAPI(APIView):
    @extend_schema(summary="Gateway keys: your own (staff: everyone's)", responses={200: KEY_LIST})
    def get(self, request: Request) -> Response:
        keys = selectors.keys_visible_to(actor_of(request))
        return Response([selectors.key_view(k) for k in keys])

    @extend_schema(
        summary="Create a gateway key for yourself; the answer holds the key, shown only once",
        request=KeyCreateInput,
        responses={201: NEW_KEY_VIEW, 400: ERROR},
    )
    def post(self, request: Request) -> Response:
        data = KeyCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        key, secret = services.key_create(actor=actor_of(request), name=data.validated_data["name"])
        return Response({**selectors.key_view(key), "key": secret}, status=status.HTTP_201_CREATED)


class KeyRevokeAPI(APIView):
    @extend_schema(
        summary="Revoke a gateway key (its owner or staff); requests with it get 401 from now on",
        request=None,
        responses={200: KEY_VIEW, 404: ERROR},
    )
    def post(self, request: Request, key_id: int) -> Response:
        key = services.key_revoke(actor=actor_of(request), key_id=key_id)
        return Response(selectors.key_view(key))

"""Gateway keys in the REST API under /api/v1/keys, for the console and `llmgw ctl`.

Any user creates keys of their own and sees and revokes their own; staff see
and revoke everyone's.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.api import actor_of, answers, out, validated
from catalog.definitions import StrictSerializer
from catalog.errors import CatalogError

from . import selectors, services
from .services import KEY_NAME_MAX


class KeyOut(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    prefix = serializers.CharField(help_text="the key's first characters")
    owner = serializers.CharField()
    state = serializers.ChoiceField(choices=["active", "revoked"])
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True, help_text="to within a minute")
    revoked_at = serializers.DateTimeField(allow_null=True)
    revoked_by = serializers.CharField(allow_null=True)


class NewKeyOut(KeyOut):
    key = serializers.CharField(help_text="the key itself: shown only in this answer")


class KeyCreateInput(StrictSerializer):
    name = serializers.CharField(
        max_length=KEY_NAME_MAX,
        help_text="what the key is for, say the application using it",
        error_messages={
            "blank": "give the key a name that says what it is for, say the application using it"
        },
    )


class KeysAPI(APIView):
    @extend_schema(
        summary="Gateway keys: your own (staff: everyone's)",
        responses=answers({200: KeyOut(many=True)}),
    )
    def get(self, request: Request) -> Response:
        keys = selectors.keys_visible_to(actor_of(request))
        return Response(out(KeyOut, [selectors.key_view(k) for k in keys], many=True))

    @extend_schema(
        summary="Create a gateway key for yourself; the answer holds the key, shown only once",
        request=KeyCreateInput,
        responses=answers({201: NewKeyOut}, 409, body=True),
    )
    def post(self, request: Request) -> Response:
        data = validated(KeyCreateInput, request.data)
        key, secret = services.key_create(actor=actor_of(request), name=data["name"])
        body = out(NewKeyOut, {**selectors.key_view(key), "key": secret})
        return Response(body, status=status.HTTP_201_CREATED)


class KeyRevokeAPI(APIView):
    @extend_schema(
        summary="Revoke a gateway key (its owner or staff); requests with it get 401 from now on",
        request=None,
        responses=answers({200: KeyOut}, 404),
    )
    def post(self, request: Request, key_id: int) -> Response:
        if key_id >= 2**62:  # no such key: a database integer could not even hold the id
            raise CatalogError(
                f"There is no gateway key {key_id} of yours; `llmgw ctl keys` lists them.",
                code="not_found",
                status=404,
            )
        key = services.key_revoke(actor=actor_of(request), key_id=key_id)
        return Response(out(KeyOut, selectors.key_view(key)))

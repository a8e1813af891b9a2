"""`llmgw ctl login`: the device authorization grant (RFC 8628), run by the control plane.

The command asks `POST /api/v1/login/device`; the control plane asks its provider for a device
code (with its client's secret, which the command never sees) and answers with the address and
the code a person enters there, and a handle of its own. The command then polls
`POST /api/v1/login/device/poll` with the handle; the control plane asks the provider's token
endpoint at most once per interval, and once the person has signed in it checks the ID token
(signin.oidc), signs them in as the console does (signin.people: the account, its groups mapped
to roles, the audit) and answers with a new API token of theirs, expiring after
LLMGW_CLI_TOKEN_DAYS. Each handle gives at most one token.

Both endpoints are open to anyone on the control plane's port: a start costs one request to the
provider and one row, at most MAX_PENDING_LOGINS rows exist at once (expired ones are deleted
first), and a poll asks the provider at most once per interval, whatever the caller's pace.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.models import DeviceLogin
from accounts.services import token_create
from core.api import answers, validated
from core.outbound import URLRefused
from core.refusals import Refused
from core.serializers import StrictSerializer

from .oidc import Provider, ProviderConfig, new_secret, provider_for, verify_id_token
from .people import sign_in

MAX_PENDING_LOGINS = 200
# However long the provider lets a device code live, a login waits at most this long.
LOGIN_MAX_SECONDS = 15 * 60
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
# RFC 8628 3.5: a `slow_down` answer adds 5 seconds to the interval.
SLOW_DOWN_SECONDS = 5
MAX_INTERVAL_SECONDS = 60
FIELD_CHARS = 2000


def _digest(handle: str) -> str:
    return hashlib.sha256(handle.encode()).hexdigest()


def _provider() -> Provider:
    config = ProviderConfig.from_settings()
    if config is None:
        raise Refused(
            "Sign-in through an identity provider is not set up on this control plane "
            "(LLMGW_OIDC_ISSUER), so `llmgw ctl login` cannot be used; ask an administrator "
            "for an API token and set LLMGW_TOKEN.",
            code="signin_off",
            status=404,
        )
    return provider_for(config)


def _text(answer: dict[str, Any], name: str, *, required: bool = True) -> str:
    value = answer.get(name)
    if isinstance(value, str) and 0 < len(value) <= FIELD_CHARS:
        return value
    if value is None and not required:
        return ""
    raise Refused(
        f"The identity provider's device sign-in answer has no usable {name}; ask an "
        "administrator to check the provider's client settings.",
        code="provider_answer_invalid",
        status=502,
    )


def _seconds(answer: dict[str, Any], name: str, default: int, most: int) -> int:
    value = answer.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return min(value, most)
    return default


class StartInput(StrictSerializer):
    client = serializers.CharField(
        max_length=100,
        required=False,
        help_text="the machine signing in, shown in the token's name",
    )


class StartOut(serializers.Serializer):
    login = serializers.CharField(help_text="the handle to poll with; keep it to yourself")
    verification_uri = serializers.CharField()
    verification_uri_complete = serializers.CharField(allow_blank=True)
    user_code = serializers.CharField()
    interval = serializers.IntegerField()
    expires_in = serializers.IntegerField()


class PollInput(StrictSerializer):
    login = serializers.CharField(max_length=100)


class PollOut(serializers.Serializer):
    status = serializers.ChoiceField(choices=["pending", "done"])
    interval = serializers.IntegerField(required=False)
    token = serializers.CharField(required=False, help_text="shown this once")
    token_id = serializers.IntegerField(required=False)
    username = serializers.CharField(required=False)
    expires_at = serializers.DateTimeField(required=False)


class DeviceLoginStartAPI(APIView):
    authentication_classes: list[Any] = []  # anyone: a token sent along is not looked at
    permission_classes = [AllowAny]

    @extend_schema(
        summary="Start `llmgw ctl login`: the address and code to sign in with at the provider",
        request=StartInput,
        responses=answers({200: StartOut}, 404, 409, 429, 502, body=True),
    )
    def post(self, request: Request) -> Response:
        data = validated(StartInput, request.data)
        provider = _provider()
        endpoint = provider.metadata().device_authorization_endpoint
        if not endpoint:
            raise Refused(
                "The identity provider offers no device sign-in (RFC 8628), so `llmgw ctl "
                "login` cannot be used with it; make an API token on the console's API tokens "
                "page and set LLMGW_TOKEN.",
                code="device_grant_missing",
                status=409,
            )
        now = timezone.now()
        DeviceLogin.objects.filter(expires_at__lte=now).delete()
        if DeviceLogin.objects.count() >= MAX_PENDING_LOGINS:
            raise Refused(
                f"{MAX_PENDING_LOGINS} command-line sign-ins are under way already; try again in "
                "a few minutes.",
                code="too_many_logins",
                status=429,
            )
        scopes = " ".join(provider.config.scopes)
        code, answer = provider.client_post(
            endpoint, "device authorization endpoint", {"scope": scopes}
        )
        if code != 200 or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else None
            raise Refused(
                f"The identity provider refused a device sign-in ({str(error or code)[:100]}); "
                "ask an administrator to allow the device grant for llmgw's client.",
                code="device_grant_refused",
                status=502,
            )
        uri = _text(answer, "verification_uri")
        complete = _text(answer, "verification_uri_complete", required=False)
        for shown in filter(None, (uri, complete)):
            try:  # the address printed to the person: the provider's own, nowhere else
                provider.config.policy().check(shown)
            except URLRefused:
                raise Refused(
                    f"The identity provider's sign-in address {shown[:200]} is not on its own "
                    "host; llmgw does not send people there.",
                    code="provider_answer_invalid",
                    status=502,
                ) from None
        lifetime = _seconds(answer, "expires_in", 600, LOGIN_MAX_SECONDS)
        interval = _seconds(answer, "interval", 5, MAX_INTERVAL_SECONDS)
        handle = new_secret()
        DeviceLogin.objects.create(
            handle_digest=_digest(handle),
            device_code=_text(answer, "device_code"),
            user_code=_text(answer, "user_code")[:100],
            interval=interval,
            client_name=data.get("client", ""),
            expires_at=now + timedelta(seconds=lifetime),
        )
        return Response(
            {
                "login": handle,
                "verification_uri": uri,
                "verification_uri_complete": complete,
                "user_code": answer["user_code"],
                "interval": interval,
                "expires_in": lifetime,
            }
        )


class DeviceLoginPollAPI(APIView):
    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(
        summary="Poll `llmgw ctl login`: pending (202), or done with a new API token (200)",
        request=PollInput,
        responses=answers({200: PollOut, 202: PollOut}, 403, 404, 410, 502, body=True),
    )
    def post(self, request: Request) -> Response:
        handle = validated(PollInput, request.data)["login"]
        now = timezone.now()
        login = DeviceLogin.objects.filter(handle_digest=_digest(handle)).first()
        if login is None:
            raise Refused(
                "No such sign-in is under way (it finished, or was never started); run "
                "`llmgw ctl login` again.",
                code="no_such_login",
                status=404,
            )
        if login.expires_at <= now:
            login.delete()
            raise Refused(
                "Nobody signed in with the code before it expired; run `llmgw ctl login` again.",
                code="login_expired",
                status=410,
            )
        due = login.polled_at is None or now - login.polled_at >= timedelta(seconds=login.interval)
        # One poll at a time asks the provider, at most once an interval: the row's polled_at
        # is taken by a conditional update.
        taken = due and DeviceLogin.objects.filter(pk=login.pk, polled_at=login.polled_at).update(
            polled_at=now
        )
        if not taken:
            return _pending(login.interval)
        provider = _provider()
        code, answer = provider.client_post(
            provider.metadata().token_endpoint,
            "token endpoint",
            {"grant_type": DEVICE_GRANT, "device_code": login.device_code},
        )
        error = answer.get("error") if isinstance(answer, dict) else None
        if code != 200:
            return _not_yet(login, error, code)
        claims = verify_id_token(
            answer.get("id_token") if isinstance(answer, dict) else None,
            provider=provider,
            nonce=None,  # the device grant sends none
        )
        # A handle gives one token: the row goes before the token is made.
        if not DeviceLogin.objects.filter(pk=login.pk).delete()[0]:
            return _pending(login.interval)
        refresh = answer.get("refresh_token")
        user = sign_in(
            claims, door="cli", refresh_token=refresh if isinstance(refresh, str) else ""
        )
        days = settings.LLMGW_CLI_TOKEN_DAYS
        with transaction.atomic():
            token, secret = token_create(
                user=user,
                name=f"llmgw ctl login{' on ' + login.client_name if login.client_name else ''}",
                expires_at=timezone.now() + timedelta(days=days),
            )
        return Response(
            {
                "status": "done",
                "token": secret,
                "token_id": token.pk,
                "username": user.get_username(),
                "expires_at": token.expires_at,
            }
        )


def _pending(interval: int) -> Response:
    return Response({"status": "pending", "interval": interval}, status=status.HTTP_202_ACCEPTED)


def _not_yet(login: DeviceLogin, error: Any, code: int) -> Response:
    """What the provider's refusal to give tokens yet means for the command."""
    if error == "authorization_pending":
        return _pending(login.interval)
    if error == "slow_down":
        interval = min(login.interval + SLOW_DOWN_SECONDS, MAX_INTERVAL_SECONDS)
        DeviceLogin.objects.filter(pk=login.pk).update(interval=interval)
        return _pending(interval)
    login.delete()
    if error == "access_denied":
        raise Refused(
            "The sign-in was refused at the identity provider; run `llmgw ctl login` again to "
            "retry.",
            code="login_denied",
            status=403,
        )
    if error == "expired_token":
        raise Refused(
            "Nobody signed in with the code before it expired; run `llmgw ctl login` again.",
            code="login_expired",
            status=410,
        )
    raise Refused(
        f"The identity provider would not finish the sign-in ({str(error or code)[:100]}); run "
        "`llmgw ctl login` again, or ask an administrator.",
        code="login_failed",
        status=502,
    )

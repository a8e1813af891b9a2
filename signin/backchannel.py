"""Back-channel logout (OpenID Connect Back-Channel Logout 1.0): the provider tells llmgw that
a person's session there ended, and their llmgw sessions end with it.

The provider POSTs a logout token (a JWT it signs) to /signin/backchannel-logout. It is checked
as an ID token is (signature by the provider's keys, issuer, audience) and by the rules of its
own (the logout event, a subject, no nonce, issued lately, each token once); the person's
sessions are then deleted. Their API tokens and keys are left alone: ending a session is not
leaving (signin.leavers). Register https://HOST/signin/backchannel-logout at the provider.
"""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from catalog.services import record_event
from core.actor import Actor
from core.refusals import Refused

from . import audit
from .leavers import end_sessions
from .models import Identity
from .oidc import ProviderConfig, provider_for, signed_claims, spend_nonce

LOGOUT_EVENT = "http://schemas.openid.net/event/backchannel-logout"
# A logout token issued longer ago than this is refused (its jti is kept for two days).
MAX_AGE_SECONDS = 300
MAX_FORM_BYTES = 64 * 1024


def _refuse(description: str) -> JsonResponse:
    # Section 2.8: 400 with an OAuth error object.
    return JsonResponse({"error": "invalid_request", "error_description": description}, status=400)


def check_logout_claims(claims: dict[str, Any], *, config: ProviderConfig, now: float) -> str:
    """The subject a logout token ends the sessions of; Refused naming what is wrong."""
    if claims.get("iss") != config.issuer:
        raise Refused("the logout token is from another issuer", code="logout_token_invalid")
    audience = claims.get("aud")
    audiences = [audience] if isinstance(audience, str) else audience
    if not isinstance(audiences, list) or config.client_id not in audiences:
        raise Refused("the logout token is meant for another client", code="logout_token_invalid")
    issued = claims.get("iat")
    if not isinstance(issued, int | float) or not now - MAX_AGE_SECONDS <= issued <= now + 60:
        raise Refused("the logout token is not from the last minutes", code="logout_token_invalid")
    events = claims.get("events")
    if not isinstance(events, dict) or not isinstance(events.get(LOGOUT_EVENT), dict):
        raise Refused(
            "the token is not a logout token (no logout event)", code="logout_token_invalid"
        )
    if "nonce" in claims:
        raise Refused("a logout token carries no nonce", code="logout_token_invalid")
    subject, jti = claims.get("sub"), claims.get("jti")
    if not isinstance(subject, str) or not subject:
        # A token naming only a provider session (sid): llmgw keeps no provider sessions.
        raise Refused("the logout token names no subject", code="logout_token_invalid")
    if not isinstance(jti, str) or not jti or len(jti) > 255:
        raise Refused("the logout token has no jti", code="logout_token_invalid")
    return subject


@csrf_exempt  # the provider's own request, authenticated by the token it signs
@require_POST
def backchannel_logout(request: HttpRequest) -> JsonResponse:
    config = ProviderConfig.from_settings()
    if config is None:
        return _refuse("sign-in through a provider is not set up here")
    length = request.META.get("CONTENT_LENGTH") or "0"
    if not length.isdigit() or int(length) > MAX_FORM_BYTES:
        return _refuse("the request is larger than a logout token, or says no length it has")
    token = request.POST.get("logout_token", "")
    provider = provider_for(config)
    try:
        claims = signed_claims(token, provider=provider)
        subject = check_logout_claims(claims, config=config, now=time.time())
        spend_nonce(f"logout:{claims['jti']}")
    except Refused as refusal:
        return _refuse(refusal.message)
    identity = (
        Identity.objects.select_related("user")
        .filter(issuer=config.issuer, subject=subject)
        .first()
    )
    if identity is not None:
        ended = end_sessions(identity.user.pk)
        user = identity.user
        record_event(
            Actor(name="provider", door="provider", user=None),
            audit.subject(user.get_username()),
            audit.SIGN_OUT,
            f"the identity provider ended their session (back-channel logout): {ended} "
            "session(s) ended",
            sessions=ended,
        )
    # Section 2.8: 200 whether or not llmgw knew the person.
    return JsonResponse({}, status=200)

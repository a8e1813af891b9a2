"""The two steps of a sign-in through the provider: /signin/start sends the browser to the
provider, /signin/callback takes its answer.

The state, nonce and PKCE verifier of a sign-in are kept in the session that started it, and
spent by the first answer that names the state, whatever that answer is: an answer from
another browser (a login CSRF), a second use of the same answer, or one after
PENDING_SECONDS is refused and changes nothing. Where a sign-in leads afterwards (`next`) is
checked when it starts: a path on this site, never another host.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.contrib.auth import login
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET

from core.refusals import Refused

from . import audit, people
from .oidc import ProviderConfig, new_secret, provider_for, verify_id_token

PENDING = "signin.pending"
# Long enough to type a password and a second factor at the provider.
PENDING_SECONDS = 600
# Sign-ins one session may have started and not finished (tabs); the oldest is dropped.
MAX_PENDING = 5
NOT_CONFIGURED = (
    "Sign-in through a provider is not configured on this llmgw (LLMGW_OIDC_ISSUER is empty): "
    "log in with your username and password."
)


def redirect_uri() -> str:
    """Where the provider sends the browser back: register exactly this at the provider."""
    return f"{settings.LLMGW_PUBLIC_URL}{reverse('signin-callback')}"


def local_path(request: HttpRequest, url: str) -> str:
    """`url` when it is a path on this site, else "" (the default page)."""
    if not url.startswith("/") or url.startswith("//") or "\\" in url:
        return ""
    safe = url_has_allowed_host_and_scheme(
        url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    )
    return url if safe else ""


def refused_page(request: HttpRequest, refusal: Refused) -> HttpResponse:
    return render(
        request,
        "signin/refused.html",
        {"message": refusal.message, "code": refusal.code},
        status=refusal.status,
    )


@require_GET
def start(request: HttpRequest) -> HttpResponse:
    config = ProviderConfig.from_settings()
    if config is None:
        return refused_page(request, Refused(NOT_CONFIGURED, code="signin_off", status=404))
    next_url = local_path(request, request.GET.get("next", ""))
    door = audit.ADMIN if next_url.startswith("/admin/") else audit.CONSOLE
    state, nonce, verifier = new_secret(), new_secret(), new_secret()
    try:
        destination = provider_for(config).authorization_url(
            state=state, nonce=nonce, verifier=verifier, redirect_uri=redirect_uri()
        )
    except Refused as refusal:
        audit.refused(username="", door=door, message=refusal.message, code=refusal.code)
        return refused_page(request, refusal)
    now = time.time()
    pending = {
        key: flow
        for key, flow in _pending(request).items()
        if now - flow.get("at", 0) < PENDING_SECONDS
    }
    while len(pending) >= MAX_PENDING:
        pending.pop(min(pending, key=lambda key: pending[key]["at"]))
    pending[state] = {
        "nonce": nonce,
        "verifier": verifier,
        "next": next_url,
        "door": door,
        "at": now,
    }
    request.session[PENDING] = pending
    return HttpResponseRedirect(destination)


@require_GET
def callback(request: HttpRequest) -> HttpResponse:
    config = ProviderConfig.from_settings()
    if config is None:
        return refused_page(request, Refused(NOT_CONFIGURED, code="signin_off", status=404))
    state = request.GET.get("state", "")
    pending = _pending(request)
    flow = pending.pop(state, None) if state else None
    # Spent now, whatever follows: an answer is taken once.
    request.session[PENDING] = pending
    door = flow["door"] if flow else audit.door_of(request)
    try:
        if flow is None:
            raise Refused(
                "This answer from the provider is not for a sign-in this browser started, or "
                "it was already used (the state does not match). Nothing was changed; start "
                "again from the login page.",
                code="state_mismatch",
            )
        if time.time() - flow["at"] > PENDING_SECONDS:
            raise Refused(
                f"This sign-in was started more than {PENDING_SECONDS // 60} minutes ago. "
                "Nothing was changed; start again from the login page.",
                code="signin_expired",
            )
        error = request.GET.get("error")
        if error is not None:
            description = request.GET.get("error_description", "")[:200]
            said = f"{error[:60]}: {description}" if description else error[:60]
            raise Refused(
                f"The provider did not sign you in ({said}). Nothing was changed; start again "
                "from the login page, or ask your provider's administrators about your access.",
                code="provider_refused",
            )
        code = request.GET.get("code", "")
        if not code:
            raise Refused(
                "The provider's answer holds no authorization code. Nothing was changed; start "
                "again from the login page.",
                code="code_missing",
            )
        provider = provider_for(config)
        answer = provider.exchange_code(
            code=code, verifier=flow["verifier"], redirect_uri=redirect_uri()
        )
        claims = verify_id_token(answer.get("id_token"), provider=provider, nonce=flow["nonce"])
    except Refused as refusal:
        audit.refused(username="", door=door, message=refusal.message, code=refusal.code)
        return refused_page(request, refusal)
    refresh_token = answer.get("refresh_token")
    try:
        user = people.sign_in(
            claims,
            door=door,
            request=request,
            refresh_token=refresh_token if isinstance(refresh_token, str) else "",
        )
    except Refused as refusal:  # audited by sign_in
        return refused_page(request, refusal)
    login(request, user, backend=audit.PROVIDER_BACKEND)
    default = "/admin/" if door == audit.ADMIN else settings.LOGIN_REDIRECT_URL
    return HttpResponseRedirect(flow["next"] or default)


def _pending(request: HttpRequest) -> dict[str, Any]:
    pending = request.session.get(PENDING)
    return dict(pending) if isinstance(pending, dict) else {}

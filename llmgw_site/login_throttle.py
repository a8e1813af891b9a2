"""Password logins (console and admin) are throttled by django-axes on two counts kept apart:
failures per username (from any address) and per client address (for any username); either
reaching the limit refuses password logins until the cool-off has passed. API tokens and gateway
keys never go through a password check. Staff lift a lockout with `manage.py
axes_reset_username USER` or `axes_reset_ip ADDRESS`.
"""

from __future__ import annotations

from typing import Any

from axes.helpers import get_client_username, get_cool_off, get_failure_limit
from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone


def client_address(request: HttpRequest) -> str | None:
    """The address failures are counted against: the peer the web process saw (REMOTE_ADDR).

    Never a forwarding header: whoever sends X-Forwarded-For chooses it, so a count kept on it
    gave every guess a fresh one. Behind the gateway, REMOTE_ADDR is the client the gateway
    saw (gateway.forwarded). Named in AXES_CLIENT_IP_CALLABLE so that axes never reads headers
    itself, as it would through django-ipware if that were ever installed.
    """
    return request.META.get("REMOTE_ADDR") or None


def recent_failures(request: HttpRequest, **match: Any) -> int:
    """Failed logins matching `match` (username= or ip_address=) within the cool-off."""
    attempts = AccessAttempt.objects.filter(**match)
    cool_off = get_cool_off(request)
    if cool_off is not None:
        attempts = attempts.filter(attempt_time__gte=timezone.now() - cool_off)
    return attempts.aggregate(failures=Sum("failures_since_start"))["failures"] or 0


def lockout_response(
    request: HttpRequest,
    original_response: HttpResponse | None = None,
    credentials: dict[str, Any] | None = None,
) -> HttpResponse:
    """The page a refused login gets (AXES_LOCKOUT_CALLABLE): which count is full, and the way out.

    axes' own page cannot tell the account's count from the address's, and the way out differs.
    """
    limit = get_failure_limit(request, credentials)
    username = get_client_username(request, credentials) or ""
    context = {
        "failure_limit": limit,
        "username": username,
        # Otherwise it is the address's count that is full.
        "account_locked": bool(username) and recent_failures(request, username=username) >= limit,
        "address": client_address(request) or "",
        "cooloff_timedelta": get_cool_off(request),
    }
    # Filled in by axes.conf (429 unless set).
    status = getattr(settings, "AXES_HTTP_RESPONSE_CODE", 429)
    return render(request, "llmgw_site/locked.html", context, status=status)


def forget_own_failures(sender: Any, request: HttpRequest, user: Any, **kwargs: Any) -> None:
    """user_logged_in: the right password clears that account's failures, and only those.

    axes' AXES_RESET_ON_SUCCESS clears every count the login touches, its address's too: with
    the address counted alone, an attacker with an account of their own would log into it
    between guesses at another's and guess for ever. A login only happens while neither count
    is full, so it never lifts a lockout.
    """
    AccessAttempt.objects.filter(username=user.get_username()).delete()

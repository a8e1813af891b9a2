"""The API tokens page: the signed-in person's own tokens (those `llmgw ctl login` made among
them), when each was last used and when it expires, each revocable. Making one is the admin's,
`manage.py llmgw_token`'s or `llmgw ctl login`'s."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from accounts import services

from .pages import HtmxHttpRequest, login_required, render_page


@require_GET
@login_required
def tokens_page(request: HtmxHttpRequest) -> HttpResponse:
    now = timezone.now()
    rows = [
        {"token": t, "expired": t.expires_at is not None and t.expires_at <= now}
        for t in services.tokens_of(request.user)
    ]
    return render_page(request, "console/tokens.html", "tokens-table", {"rows": rows})


@require_POST
@login_required
def token_revoke(request: HtmxHttpRequest, token_id: int) -> HttpResponse:
    token = services.token_revoke(user=request.user, token_id=token_id)
    if token is None:
        messages.error(request, f"You have no API token {token_id} (it may be revoked already).")
    else:
        messages.success(
            request,
            f"{token.prefix}… ({token.name or 'unnamed'}) is revoked: requests with it get 401.",
        )
    return redirect("console-tokens")

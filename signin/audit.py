"""Sign-ins, their refusals and sign-outs in the audit, under the subject "user NAME".

Recorded while sign-in through a provider is configured (LLMGW_OIDC_ISSUER): a provider's
sign-ins (signin.people), a password login (which then is a break-glass administrator's, or
anyone's while local passwords stay on), a password refused because local passwords are off,
a refused provider sign-in, and every log-out. Without a provider nothing here is written, as
before this app existed.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY
from django.contrib.auth.signals import user_logged_in, user_logged_out
from django.http import HttpRequest

from catalog.services import record_change, record_event
from core.actor import Actor

log = logging.getLogger("llmgw.signin")

SIGN_IN, REFUSED, SIGN_OUT = "sign-in", "sign-in-refused", "sign-out"
CONSOLE, ADMIN = "console", "admin"
# The backend a provider's sign-in logs in with (signin.backends.ProviderBackend).
PROVIDER_BACKEND = "signin.backends.ProviderBackend"


def subject(username: str) -> str:
    return f"user {username}"[:100]  # the audit's subject column holds 100 characters


def door_of(request: HttpRequest | None) -> str:
    """The admin's pages are the admin's door; every other login page is the console's."""
    path = getattr(request, "path", "") or ""
    return ADMIN if path.startswith("/admin/") else CONSOLE


def enabled() -> bool:
    return bool(settings.LLMGW_OIDC_ISSUER.strip())


def signed_in(
    actor: Actor, before: dict[str, Any] | None, after: dict[str, Any], note: str
) -> None:
    record_change(actor, subject(actor.name), SIGN_IN, before, after, note)


def refused(*, username: str, door: str, message: str, code: str, user: Any = None) -> None:
    """A refused sign-in: written in a transaction of its own, after the refused one rolled back."""
    name = username or "(unknown)"
    log.info("signin: refused %s through the %s (%s): %s", name, door, code, message)
    record_event(
        Actor(name=name[:150], door=door, user=user), subject(name), REFUSED, message, code=code
    )


def _password_login(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    session = getattr(request, "session", None)
    backend = session.get(BACKEND_SESSION_KEY) if session is not None else None
    if not enabled() or backend == PROVIDER_BACKEND:
        return  # signin.people.sign_in writes the provider's own, with what changed
    actor = Actor.for_user(user, door_of(request))
    signed_in(actor, None, {"with": "password"}, "logged in with a local password")


def _logout(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    if not enabled() or user is None:
        return
    actor = Actor.for_user(user, door_of(request))
    record_event(actor, subject(actor.name), SIGN_OUT, "logged out")


def connect() -> None:
    user_logged_in.connect(_password_login, dispatch_uid="signin.audit.password_login")
    user_logged_out.connect(_logout, dispatch_uid="signin.audit.logout")

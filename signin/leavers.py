"""People who leave lose everything: their console sessions, API tokens and gateway keys.

How llmgw learns someone left:
- an administrator deactivates the account (console, admin): Django refuses an inactive user's
  session and API tokens at the next request, and the gateway stops the user's keys as soon as
  the database says so (access.triggers: the owner's is_active);
- the provider no longer accepts their refresh token (removed, disabled, their grant revoked),
  or their groups no longer map to any role: found by `check_members`, run by beat every 20 s
  over the identities not checked for LLMGW_OIDC_RECHECK_SECONDS (40; a batch a run), and
  for each such person `leave` deactivates the account, revokes every API token, ends every
  session, and says why in the audit;
- the provider ends their session and tells llmgw (back-channel logout, signin.views): their
  sessions end; they are not a leaver for that (they may sign in again).

Someone deactivated this way who is back in a mapped group signs in again only once an
administrator turns the account on (signin.people: a deactivated account stays so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from accounts.services import revoke_all
from catalog.services import record_event
from core.actor import SYSTEM, Actor
from core.refusals import Refused

from . import audit
from .models import Identity
from .oidc import ProviderConfig, ProviderUnavailable
from .people import refresh_token_of

log = logging.getLogger("llmgw.signin")

LEAVE = "leaver"
# Identities asked about in one run (beat's every 20 s): the next run takes the next ones.
CHECK_BATCH = 100
# Sessions read in one query while looking for a user's (their data is encoded, so each is read).
SESSIONS_CHUNK = 2000


def end_sessions(user_id: int) -> int:
    """Delete every unexpired session of the user; how many there were."""
    ended = 0
    live = Session.objects.filter(expire_date__gt=timezone.now()).order_by("pk")
    last = ""
    while True:
        chunk = list(live.filter(pk__gt=last)[:SESSIONS_CHUNK])
        if not chunk:
            return ended
        last = chunk[-1].pk
        theirs = [s.pk for s in chunk if str(s.get_decoded().get("_auth_user_id")) == str(user_id)]
        if theirs:
            ended += Session.objects.filter(pk__in=theirs).delete()[0]


def leave(user: Any, *, why: str, actor: Actor = SYSTEM) -> dict[str, int]:
    """Deactivate `user` for `why`: sessions ended, API tokens revoked, gateway keys stopped
    (by the gateway, which follows is_active); audited once. Idempotent."""
    User = get_user_model()
    with transaction.atomic():
        turned_off = User.objects.filter(pk=user.pk, is_active=True).update(is_active=False)
        tokens = revoke_all(user)
        sessions = end_sessions(user.pk)
        if turned_off or tokens or sessions:
            record_event(
                actor,
                audit.subject(user.get_username()),
                LEAVE,
                f"deactivated: {why}; {tokens} API token(s) revoked, {sessions} session(s) "
                "ended, their gateway keys stop",
                tokens=tokens,
                sessions=sessions,
            )
    user.is_active = False
    return {"tokens": tokens, "sessions": sessions}


@dataclass
class CheckRun:
    checked: int = 0
    left: list[str] = field(default_factory=list)
    # No refresh token to ask with, or the provider's answer says nothing of groups: they are
    # checked at their next sign-in.
    unknown: int = 0
    stopped: str = ""  # the provider could not be asked: nothing was decided of the rest


def check_members(*, batch: int = CHECK_BATCH) -> CheckRun:
    """Ask the provider about the identities not checked for LLMGW_OIDC_RECHECK_SECONDS (active
    users, a batch of them, the longest unchecked first), through each one's refresh token:
    their groups are brought up to date, and those it refuses, or whose groups map to no role,
    leave. A provider that cannot be asked stops the run: that says nothing about anyone."""
    from access import roles

    from .people import NO_ID_TOKEN, refresh_identity

    run = CheckRun()
    config = ProviderConfig.from_settings()
    if config is None:
        return run
    now = timezone.now()
    due = now - timedelta(seconds=settings.LLMGW_OIDC_RECHECK_SECONDS)
    identities = (
        Identity.objects.select_related("user")
        .filter(issuer=config.issuer, user__is_active=True)
        .filter(Q(checked_at__isnull=True) | Q(checked_at__lt=due))
        .order_by(F("checked_at").asc(nulls_first=True), "pk")[:batch]
    )
    for identity in identities:
        if not refresh_token_of(identity):
            run.unknown += 1
            Identity.objects.filter(pk=identity.pk).update(checked_at=now)
            continue
        try:
            claims = refresh_identity(identity)
        except ProviderUnavailable as exc:
            if exc.code == NO_ID_TOKEN:
                run.unknown += 1
                Identity.objects.filter(pk=identity.pk).update(checked_at=now)
                continue
            run.stopped = exc.message
            log.warning("signin: membership check stopped: %s", exc.message)
            break
        except Refused as refusal:
            claims, why = None, f"the provider's answer was refused ({refusal.message})"
        else:
            why = "the identity provider no longer accepts their sign-in (removed or disabled)"
        run.checked += 1
        user = identity.user
        if claims is not None:
            Identity.objects.filter(pk=identity.pk).update(
                groups=list(claims.groups), checked_at=now
            )
            try:
                roles.apply_groups(user, list(claims.groups), actor=SYSTEM)
                continue
            except Refused as refusal:
                why = f"their groups map to no role ({refusal.message})"
        Identity.objects.filter(pk=identity.pk).update(checked_at=now)
        leave(user, why=why)
        run.left.append(user.get_username())
    return run

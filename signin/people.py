"""People made and kept up to date from the provider's word: the user of an identity is made at
its first sign-in and its e-mail, name and groups are written at each, then the groups are
mapped to teams and roles (access.roles), all in one transaction with its audit entry.

Decisions (docs/signin.md says the same to administrators):
- A user is found by the token's issuer and subject alone, never by e-mail or username: an
  account made by hand is never taken over by someone whose provider says the same address.
- A user deactivated in llmgw (is_active off) stays out: the provider cannot reactivate them.
  An administrator turns them on again in the admin.
- Groups that give no role (access.roles.apply_groups refuses) refuse the sign-in. At a first
  sign-in nothing is kept; for someone known, their new groups are recorded and the roles the
  mapping gave them are taken away, so that their API tokens hold no more than the groups say.
- A new user gets no usable password: they sign in through the provider, whatever the
  password setting says.
- Their username comes from preferred_username, else the e-mail address, reduced to ASCII
  letters, digits and . @ + - _ (else "user-" and a digest of issuer and subject); a name already taken (by anyone, in any case) or reserved
  for a break-glass administrator gets -2, -3, ... A username is never changed afterwards.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.http import HttpRequest
from django.utils import timezone
from django.utils.crypto import salted_hmac

from core.actor import Actor
from core.refusals import Refused, forbidden

from . import audit
from .models import Identity
from .oidc import Claims, ProviderConfig, ProviderUnavailable, provider_for, verify_id_token

_NOT_IN_A_USERNAME = re.compile(r"[^A-Za-z0-9_.@+-]")
USERNAME_CHARS = 120  # leaves room for a suffix within Django's 150
# Fewer is what is left of a name in another script ("ünï" gives "n"): the fallback is clearer.
MIN_USERNAME_CHARS = 3
DEACTIVATED = (
    "Your llmgw account {username} was deactivated by an administrator, so signing in with "
    "your company's account does not reactivate it. Ask an llmgw administrator to turn it on "
    "again."
)


def sign_in(
    claims: Claims, *, door: str, request: HttpRequest | None = None, refresh_token: str = ""
) -> Any:
    """The user of `claims`, made or brought up to date, with their groups mapped to roles;
    audited. Refused (and audited as a refusal, with nothing else written) when llmgw will not
    let them in."""
    for attempt in (1, 2):
        try:
            return _sign_in_once(claims, door=door, refresh_token=refresh_token)
        except IntegrityError:
            # The same person's first sign-in in two tabs at once, or a username taken between
            # the check and the insert: the second attempt finds what the first one made.
            if attempt == 2:
                raise
        except Refused as refusal:
            identity = Identity.objects.filter(issuer=claims.issuer, subject=claims.subject)
            user = identity.select_related("user").first()
            audit.refused(
                username=user.user.get_username() if user else _username_hint(claims),
                door=door,
                message=refusal.message,
                code=refusal.code,
                user=user.user if user else None,
            )
            raise
    raise AssertionError("unreachable")


def _sign_in_once(claims: Claims, *, door: str, refresh_token: str) -> Any:
    from access import roles

    User = get_user_model()
    refusal: Refused | None = None
    with transaction.atomic():
        identity = (
            Identity.objects.select_for_update()
            .select_related("user")
            .filter(issuer=claims.issuer, subject=claims.subject)
            .first()
        )
        if identity is None:
            user = User(username=_free_username(claims))
            user.set_unusable_password()
            before = None
        else:
            user = identity.user
            if not user.is_active:
                raise forbidden(DEACTIVATED.format(username=user.get_username()))
            before = _record(user, identity.groups)
        user.email = claims.email
        user.first_name, user.last_name = _names(claims)
        user.save()
        if identity is None:
            identity = Identity(issuer=claims.issuer, subject=claims.subject, user=user)
        identity.groups = list(claims.groups)
        identity.signed_in_at = timezone.now()
        if refresh_token:
            identity.refresh_token = _seal(refresh_token)
        identity.save()
        actor = Actor.for_user(user, door)
        try:
            roles.apply_groups(user, list(claims.groups), actor=actor)
        except Refused as refused:
            if before is None:
                raise  # a first sign-in refused leaves no account behind
            # Someone known whose groups no longer give a role: what the provider says now is
            # kept (and the roles it gave are gone, so their API tokens hold no more than their
            # groups say), but they are not let in.
            refusal = refused
        else:
            note = "first sign-in: the account was made" if before is None else "signed in"
            audit.signed_in(actor, before, _record(user, identity.groups), f"{note} (provider)")
    if refusal is not None:
        raise refusal
    return user


def _record(user: Any, groups: list[str]) -> dict[str, Any]:
    return {
        "email": user.email,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "groups": list(groups),
    }


def _names(claims: Claims) -> tuple[str, str]:
    if claims.given_name or claims.family_name:
        return claims.given_name[:150], claims.family_name[:150]
    first, _, last = claims.name.partition(" ")
    return first[:150], last.strip()[:150]


def _username_hint(claims: Claims) -> str:
    for hint in (claims.preferred_username, claims.email):
        cleaned = _NOT_IN_A_USERNAME.sub("", hint).strip(".-+@")[:USERNAME_CHARS]
        if len(cleaned) >= MIN_USERNAME_CHARS:
            return cleaned
    digest = hashlib.sha256(f"{claims.issuer}\n{claims.subject}".encode()).hexdigest()
    return f"user-{digest[:12]}"


def _free_username(claims: Claims) -> str:
    """A username nobody has (in any case) and no break-glass administrator is kept for."""
    User = get_user_model()
    base = _username_hint(claims)
    reserved = {name.lower() for name in settings.LLMGW_BREAK_GLASS_USERS}
    candidate, number = base, 1
    while (
        candidate.lower() in reserved
        or User._default_manager.filter(username__iexact=candidate).exists()
    ):
        number += 1
        candidate = f"{base}-{number}"
    return candidate


# -- the refresh token, sealed ----------------------------------------------------------------


def _fernet() -> Fernet:
    key = salted_hmac("signin.refresh_token", "fernet", algorithm="sha256").digest()
    return Fernet(base64.urlsafe_b64encode(key))


def _seal(token: str) -> str:
    return _fernet().encrypt(token.encode()).decode("ascii")


def refresh_token_of(identity: Identity) -> str:
    """The identity's refresh token in clear, or "" when there is none or it cannot be read
    (sealed under another LLMGW_SECRET_KEY)."""
    if not identity.refresh_token:
        return ""
    try:
        return _fernet().decrypt(identity.refresh_token.encode("ascii")).decode()
    except (InvalidToken, ValueError):
        return ""


NO_ID_TOKEN = "refresh_without_id_token"


def refresh_identity(identity: Identity) -> Claims | None:
    """What the provider says of the identity now, through its refresh token: the claims of the
    new ID token (its groups included), or None when it has no usable refresh token or the
    provider refuses it (the person was removed, or the grant was revoked). A new refresh token,
    when the provider rotates them, is kept. ProviderUnavailable when the provider cannot be
    asked: that says nothing about the person."""
    config = ProviderConfig.from_settings()
    token = refresh_token_of(identity)
    if config is None or not token or identity.issuer != config.issuer:
        return None
    provider = provider_for(config)
    try:
        answer = provider.refresh(token)
    except Refused as refusal:
        if refusal.status == 400:
            return None
        raise
    rotated = answer.get("refresh_token")
    if isinstance(rotated, str) and rotated and rotated != token:
        identity.refresh_token = _seal(rotated)
        identity.save(update_fields=["refresh_token"])
    id_token = answer.get("id_token")
    if not isinstance(id_token, str):
        # Not a refusal: the provider answers a refresh without an ID token, so it cannot say
        # what the person's groups are now (signin.leavers counts them as not known).
        raise ProviderUnavailable(
            "The provider's answer to a refresh holds no ID token, so it tells nothing of the "
            "person's groups.",
            code=NO_ID_TOKEN,
        )
    claims = verify_id_token(id_token, provider=provider, nonce=None)
    if claims.subject != identity.subject:
        return None
    return claims

"""How people log in: a local password (refused while local passwords are off, but for the
break-glass administrators), or a sign-in through the provider.

The console's login, the admin's login and anything else calling authenticate() go through
PasswordBackend, so switching local passwords off covers every password form at once.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.backends import BaseBackend, ModelBackend
from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpRequest

from . import audit

PASSWORDS_OFF = (
    "Local passwords are switched off: sign in with your company's account. Only the "
    "break-glass administrators may still log in with a password."
)


def passwords_allowed(username: str | None) -> bool:
    """Whether `username` may log in with a local password now."""
    if settings.LLMGW_LOCAL_PASSWORDS:
        return True
    return bool(username) and username in settings.LLMGW_BREAK_GLASS_USERS


class PasswordBackend(ModelBackend):
    """Django's own (passwords, and the permissions of every user however they logged in),
    refusing passwords while LLMGW_LOCAL_PASSWORDS is off, but for LLMGW_BREAK_GLASS_USERS."""

    def authenticate(  # type: ignore[override]
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> AbstractBaseUser | None:
        if username is None:
            username = kwargs.get(self._username_field())
        if password is not None and not passwords_allowed(username):
            audit.refused(
                username=str(username or "")[:150],
                door=audit.door_of(request),
                message=PASSWORDS_OFF,
                code="local_passwords_off",
            )
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)

    @staticmethod
    def _username_field() -> str:
        from django.contrib.auth import get_user_model

        return get_user_model().USERNAME_FIELD


class ProviderBackend(BaseBackend):
    """The backend a provider's sign-in is recorded with in the session: it authenticates
    nothing itself (signin.views does, with the provider's ID token) and keeps a session only
    while its user is active. Permissions come from PasswordBackend, as for everyone."""

    def get_user(self, user_id: Any) -> AbstractBaseUser | None:  # type: ignore[override]
        from django.contrib.auth import get_user_model

        User = get_user_model()
        user = User._default_manager.filter(pk=user_id).first()
        return user if user is not None and user.is_active else None

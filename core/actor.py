"""Who makes a change, and through which door: every service takes an Actor and every audit
entry records one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .refusals import forbidden


@dataclass(frozen=True)
class Actor:
    """Who is making a change and through which door (api, cli, console, admin, config, system)."""

    name: str
    door: str
    user: Any = None  # a User, or None for config and system

    @classmethod
    def for_user(cls, user: Any, door: str) -> Actor:
        return cls(name=user.get_username(), door=door, user=user)

    @property
    def is_staff(self) -> bool:
        return bool(self.user is not None and getattr(self.user, "is_staff", False))

    @property
    def is_installation(self) -> bool:
        """server.yaml or the system itself, not a person."""
        return self.door in ("config", "system")


CONFIG = Actor(name="config", door="config")
SYSTEM = Actor(name="system", door="system")


def require_staff(actor: Actor, what: str) -> None:
    """Things that act on the whole installation rather than on one's own: staff only (and the
    installation itself). `what` completes "Only staff may …", like "add nodes"."""
    if actor.is_installation or actor.is_staff:
        return
    raise forbidden(f"Only staff may {what}; ask an administrator.")

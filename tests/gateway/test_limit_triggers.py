"""A change of a key's limits, team or expiry, of a team, or of a team's members reaches a running
gateway process through the database's own notification (access.triggers), whichever door wrote
it: here a plain UPDATE, as the admin or a shell makes one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from access import triggers
from access.models import GatewayKey, LimitFields, Team, hash_key
from access.services import key_create
from core.actor import Actor
from gateway import state as gateway_state
from tests.gateway.conftest import GatewayServer
from tests.support.gateway_state import current_state
from tests.support.waiting import wait_for

pytestmark = pytest.mark.smoke

# How soon a change reaches the running process: what these tests allow it.
WITHIN = 1.0


@pytest.fixture
def front(transactional_db: Any, monkeypatch: Any) -> Iterator[GatewayServer]:
    # Only a notification makes the process read again: its read every SAFETY_SECONDS anyway
    # would otherwise hide a trigger that does not fire.
    monkeypatch.setattr(gateway_state, "SAFETY_SECONDS", 3600.0)
    running = GatewayServer(lifespan=True)
    yield running
    running.stop()


def held(secret: str) -> Any:
    """The limits the running process holds for this key (None: it has none)."""
    return current_state().get().keys.get(hash_key(secret)).limits


def test_every_limit_field_is_watched_by_a_trigger() -> None:
    # The twin of LimitFields in SQL: a field added there and not here would not reach the gateway.
    columns = [f.column for f in LimitFields._meta.local_fields]
    assert set(columns) <= set(triggers.LIMIT_COLUMNS)
    assert {"team_id", "expires_at"} <= set(triggers.KEY_COLUMNS)
    watched = dict(triggers.WATCHED)
    assert {f.column for f in Team._meta.concrete_fields} - {"id", "created_at"} <= set(
        watched["gateway_team"]
    )
    assert watched["gateway_team_members"] == ["team_id", "user_id"]


def test_a_change_of_a_keys_limits_team_or_expiry_reaches_the_gateway(
    front: GatewayServer, users: dict[str, Any]
) -> None:
    team = Team.objects.create(name="research")
    key, secret = key_create(actor=Actor.for_user(users["alice"], "api"), name="app")
    wait_for(
        lambda: current_state().get().keys.get(hash_key(secret)) is not None,
        timeout=WITHIN,
        what="the new key held by the gateway",
    )
    assert held(secret) is None  # a key without limits costs the gateway nothing more

    expires = timezone.now() + timedelta(days=3)
    changes: list[tuple[str, Any, Callable[[Any], bool]]] = [
        ("rpm", 5, lambda h: h.rpm == 5),
        ("tpm", 600, lambda h: h.tpm == 600),
        ("max_parallel", 2, lambda h: h.max_parallel == 2),
        ("tokens_per_day", 7000, lambda h: h.tokens_per_day == 7000),
        ("tokens_per_month", 80000, lambda h: h.tokens_per_month == 80000),
        ("models", ["llama-*"], lambda h: h.models == ("llama-*",)),
        ("weight", 3.0, lambda h: h.weight == 3.0),
        ("team_id", team.pk, lambda h: h.team_id == team.pk),
        ("expires_at", expires, lambda h: h.expires_at == pytest.approx(expires.timestamp())),
    ]
    for field, value, arrived in changes:
        stamped = GatewayKey.objects.get(pk=key.pk).changed_at
        GatewayKey.objects.filter(pk=key.pk).update(**{field: value})
        assert GatewayKey.objects.get(pk=key.pk).changed_at > stamped, field
        wait_for(
            lambda arrived=arrived: held(secret) is not None and arrived(held(secret)),
            timeout=WITHIN,
            what=f"the key's {field} to reach the gateway",
        )

    # Lifted again, the key goes back to costing nothing.
    GatewayKey.objects.filter(pk=key.pk).update(
        rpm=None,
        tpm=None,
        max_parallel=None,
        tokens_per_day=None,
        tokens_per_month=None,
        models=[],
        weight=1.0,
        team=None,
        expires_at=None,
    )
    wait_for(
        lambda: held(secret) is None, timeout=WITHIN, what="the key's limits lifted in the gateway"
    )


def test_a_change_of_a_team_or_its_members_reaches_the_gateway(
    front: GatewayServer, users: dict[str, Any]
) -> None:
    team = Team.objects.create(name="research")
    wait_for(
        lambda: team.pk in current_state().get().teams, timeout=WITHIN, what="the new team held"
    )
    for field, value in [
        ("rpm", 50),
        ("tpm", 9000),
        ("max_parallel", 4),
        ("tokens_per_day", 10**6),
        ("tokens_per_month", 10**7),
        ("weight", 2.5),
    ]:
        Team.objects.filter(pk=team.pk).update(**{field: value})
        wait_for(
            lambda field=field, value=value: (
                getattr(current_state().get().teams[team.pk], field) == value
            ),
            timeout=WITHIN,
            what=f"a team's {field} to reach the gateway",
        )
    Team.objects.filter(pk=team.pk).update(models=["a*", "b"])
    wait_for(
        lambda: current_state().get().teams[team.pk].models == ("a*", "b"),
        timeout=WITHIN,
        what="a team's models to reach the gateway",
    )

    # Members: the process reads again (a new snapshot) on each change of the members table.
    for change in (
        lambda: team.members.add(users["alice"]),
        lambda: team.members.remove(users["alice"]),
    ):
        before = current_state().get()
        change()
        wait_for(
            lambda before=before: current_state().get() is not before,
            timeout=WITHIN,
            what="the gateway to read again after a change of the team's members",
        )

    Team.objects.filter(pk=team.pk).delete()
    wait_for(
        lambda: team.pk not in current_state().get().teams,
        timeout=WITHIN,
        what="the deleted team gone",
    )

"""Upgrading keeps every key's limits, and what staff set on a key becomes its ceiling.

The test takes the database back to before ceilings (gateway 0008), fills it as an installation
of that time would be (keys whose limits their owners and staff set, with the audit entries
those changes wrote), runs `migrate` as an upgrade does, and checks each key's ceilings and
limits. It is smoke, so CI runs it on PostgreSQL (the whole suite) and on SQLite (the smoke
part).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from access.models import GatewayKey, KeyPolicy
from access.services import key_set_limits
from catalog.models import AuditEntry
from core.actor import Actor
from core.refusals import Refused

pytestmark = [pytest.mark.smoke, pytest.mark.django_db(transaction=True)]

BEFORE_CEILINGS = ("access", "0008_traffic_slowest_request")
COUNTERS = ["rpm", "tpm", "max_parallel", "tokens_per_day", "tokens_per_month"]
EXPIRES = datetime(2999, 1, 31, tzinfo=UTC)


def _record(owner: str, **settings: Any) -> dict[str, Any]:
    """A key's settings as the audit of that time kept them (access.services._key_record)."""
    record: dict[str, Any] = {
        "name": "bot",
        "owner": owner,
        "team": None,
        "expires_at": None,
        **dict.fromkeys(COUNTERS),
        "models": [],
        "weight": 1.0,
    }
    return {**record, **settings}


def _fill_as_before_ceilings(users: dict[str, Any]) -> dict[str, int]:
    """Keys and their audit, written through the models as they were at gateway 0008."""
    old = MigrationExecutor(connection).loader.project_state(BEFORE_CEILINGS).apps
    OldKey = old.get_model("access", "GatewayKey")
    made: dict[str, int] = {}

    def key(name: str, owner: str, **settings: Any) -> Any:
        row = OldKey.objects.create(
            name=name,
            owner_id=users[owner].pk,
            prefix=f"llmgw-{name}",
            key_hash=name.ljust(64, "0"),
            **settings,
        )
        made[name] = row.pk
        return row

    def changed(row: Any, actor: str, before: dict[str, Any], after: dict[str, Any]) -> None:
        # The audit's table is as today's: only the gateway went back.
        AuditEntry.objects.create(
            actor_name=actor,
            actor_id=users[actor].pk,
            model_name=f"key #{row.pk}",
            action="key-limits",
            door="api",
            before=before,
            after=after,
            changes={k: [before[k], after[k]] for k in after if before[k] != after[k]},
        )

    # Staff set a budget and the models; the owner narrowed the models since.
    first = key("budget", "alice", rpm=10, tokens_per_day=5000, models=["llama-3b"])
    made_by_owner = _record("alice", rpm=10)
    by_staff = _record("alice", rpm=10, tokens_per_day=5000, models=["llama-*"])
    changed(first, "staff", made_by_owner, by_staff)
    changed(first, "alice", by_staff, {**by_staff, "models": ["llama-3b"]})
    # Staff set an rpm; the row was changed since outside the audit (a shell): not theirs now.
    second = key("shell", "alice", rpm=200)
    changed(second, "staff", _record("alice"), _record("alice", rpm=100))
    # Staff lifted a limit: nothing to hold.
    third = key("lifted", "bob")
    changed(third, "staff", _record("bob", tpm=50), _record("bob"))
    # Staff gave a weight and an expiry.
    fourth = key("weighty", "bob", weight=3.0, expires_at=EXPIRES)
    changed(
        fourth,
        "staff",
        _record("bob"),
        _record("bob", weight=3.0, expires_at=EXPIRES.isoformat()),
    )
    # The owner set everything there is on this one.
    fifth = key("own", "carol", rpm=7, max_parallel=2)
    changed(fifth, "carol", _record("carol"), _record("carol", rpm=7, max_parallel=2))
    # No audit at all.
    key("quiet", "carol", tokens_per_month=9)
    return made


def test_staff_set_figures_become_ceilings_and_no_limit_is_lost(users: dict[str, Any]) -> None:
    call_command("migrate", "access", BEFORE_CEILINGS[1], verbosity=0)
    with connection.cursor() as cursor:
        columns = [
            c.name
            for c in connection.introspection.get_table_description(cursor, "gateway_gatewaykey")
        ]
        tables = connection.introspection.table_names(cursor)
    assert "ceilings" not in columns and "gateway_keypolicy" not in tables
    made = _fill_as_before_ceilings(users)

    call_command("migrate", verbosity=0)  # the upgrade

    keys = {k.name: k for k in GatewayKey.objects.all()}
    assert keys["budget"].ceilings == {"tokens_per_day": 5000}
    assert keys["shell"].ceilings == {}
    assert keys["lifted"].ceilings == {}
    assert keys["weighty"].ceilings == {"weight": 3.0, "expires_at": EXPIRES.isoformat()}
    assert keys["own"].ceilings == {} and keys["quiet"].ceilings == {}
    # Every limit is where it was.
    limits = {
        name: (k.rpm, k.tpm, k.max_parallel, k.tokens_per_day, k.tokens_per_month, k.models)
        for name, k in keys.items()
    }
    assert limits == {
        "budget": (10, None, None, 5000, None, ["llama-3b"]),
        "shell": (200, None, None, None, None, []),
        "lifted": (None, None, None, None, None, []),
        "weighty": (None, None, None, None, None, []),
        "own": (7, None, 2, None, None, []),
        "quiet": (None, None, None, None, 9, []),
    }
    assert (keys["weighty"].weight, keys["weighty"].expires_at) == (3.0, EXPIRES)
    assert not KeyPolicy.objects.exists()

    # And they hold: the owner lowers the budget staff set, and cannot lift it.
    alice = Actor.for_user(users["alice"], "cli")
    with pytest.raises(Refused, match="tokens_per_day: none \\(no limit\\) is above the ceiling"):
        key_set_limits(actor=alice, key_id=made["budget"], changes={"tokens_per_day": "none"})
    assert (
        key_set_limits(
            actor=alice, key_id=made["budget"], changes={"tokens_per_day": 100}
        ).tokens_per_day
        == 100
    )
    bob = Actor.for_user(users["bob"], "cli")
    with pytest.raises(Refused, match="expires: never is later than the expiry of 2999-01-31"):
        key_set_limits(actor=bob, key_id=made["weighty"], changes={"expires": "none"})

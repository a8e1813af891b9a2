"""The one list of what the gateway routes by (access.routed) and its twin in SQL, the triggers
(access.triggers): a change of every field on the list reaches a running gateway process
through the database's notification, whichever door wrote it (here a plain UPDATE, as the admin
or a shell makes one), and the reads select nothing the list leaves out."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import apps
from django.db import connection, models
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from access import routed, triggers
from access.models import Team, UserWeight
from catalog.models import Model
from fleet.models import Node, Replica, hash_token
from gateway import state as gateway_state
from gateway.routing import read_catalog, read_replicas
from gateway.state import _unplaceable, read_teams, read_user_weights
from tests.gateway.conftest import Catalog, GatewayServer
from tests.support.gateway_state import current_state
from tests.support.waiting import stays, wait_for

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


def all_read() -> None:
    """Waits for the running process to have read every change committed until now: a look
    that began after a commit has taken its notification (GatewayState.looked_since)."""
    now = time.monotonic()
    wait_for(
        lambda: current_state().looked_since(now),
        timeout=10,
        what="the gateway's refresher to take every change committed so far",
    )


@pytest.fixture
def rows(catalog: Catalog, users: dict[str, Any]) -> dict[type[models.Model], Any]:
    """One row of each routed table, by model, with a second of each for a relation to point
    to instead; the JSON fields hold values of the shape the gateway reads."""
    chat = catalog.add("chat", min_replicas=0, max_replicas=1)
    catalog.add("other")
    Model.objects.filter(pk=chat.pk).update(
        fallbacks=["other"], adapters=[{"name": "chat-lora", "source": "x"}]
    )
    Node.objects.create(
        name="node-b", token_hash=hash_token("node-b"), address="127.0.0.2", memory_gb=8, cores=4
    )
    replica = catalog.replica("chat", 8001, adapters=("chat-lora",))
    team = Team.objects.create(name="research", models=["chat*"])
    Team.objects.create(name="ops")
    team.members.add(users["alice"])
    member = Team.members.through.objects.get(team=team, user=users["alice"])
    weight = UserWeight.objects.create(user=users["alice"], weight=2)
    return {Model: chat, Replica: replica, Node: catalog.node, Team: team, member.__class__: member,
            UserWeight: weight}  # fmt: skip


def other_value(field: models.Field, current: Any) -> Any:
    """A value of the field's kind that differs from `current` and that the gateway's reads take."""
    if field.is_relation:
        assert field.related_model is not None and not isinstance(field.related_model, str)
        return field.related_model._default_manager.exclude(pk=current).values("pk")[0]["pk"]
    if field.choices:
        return next(value for value, _ in field.choices if value != current)
    kind = field.get_internal_type()
    if kind == "BooleanField":
        return not current
    if kind.endswith("IntegerField"):
        return (current or 0) + 1
    if kind == "FloatField":
        return (current or 0) + 1.5
    if kind == "DateTimeField":
        return None if current is not None and field.null else timezone.now()
    if kind == "JSONField":
        if isinstance(current, list):
            return current + current[:1] if current else ["x"]
        return {**(current or {}), "changed": True}
    if kind in ("CharField", "TextField"):
        return current[:-1] + ("b" if current.endswith("a") else "a") if current else "a"
    raise AssertionError(f"{field} is routed: say here how the test changes a {kind}")


def test_every_name_on_the_list_is_a_column_of_its_table() -> None:
    for table in routed.routed():
        for name in table.fields:
            path = routed.field_path(table.model, name)  # raises for a name that is not a column
            assert path[0][0] is table.model
        assert set(table.set_or_cleared) <= set(table.fields)


def test_the_triggers_watch_every_routed_column_that_can_change() -> None:
    watched = {w.table: w for w in triggers.ROUTED}
    for table in routed.routed():
        for name in table.fields:
            for model, field in routed.field_path(table.model, name):
                columns = watched[model._meta.db_table].columns
                columns += watched[model._meta.db_table].set_or_cleared
                assert routed.never_changes(field) or field.column in columns, name
    # What was missing before the list: a model's way of picking a replica, and what decides
    # whether an on-demand model fits on a node.
    assert {"routing", "source", "sha256", "context_length"} <= set(
        watched["catalog_model"].columns
    )
    assert watched["fleet_node"].set_or_cleared == ["last_heartbeat"]
    assert watched["fleet_replica"].columns[-2:] == ["withdrawn_at", "model_id"]
    # Only an update of an owner's name matters; users coming and going do not.
    assert watched["auth_user"].columns == ["username"] and not watched["auth_user"].rows


def test_the_reads_select_and_filter_by_nothing_the_triggers_do_not_watch(
    rows: dict[type[models.Model], Any],
) -> None:
    Node.objects.update(last_heartbeat=timezone.now())  # schedulable: _unplaceable reads them
    with CaptureQueriesContext(connection) as queries:
        catalog = read_catalog()
        read_replicas()
        assert _unplaceable(catalog) == {}  # it read the nodes and chat, an on-demand model
        read_teams()
        read_user_weights()
    used: set[tuple[str, str]] = set()
    for query in queries.captured_queries:
        used |= set(re.findall(r'"(\w+)"\."(\w+)"', query["sql"]))
    by_table = {m._meta.db_table: m for m in apps.get_models(include_auto_created=True)}
    watched = {w.table: w.columns + w.set_or_cleared for w in triggers.ROUTED}
    unchanging = {
        table: {f.column for f in model._meta.concrete_fields if routed.never_changes(f)}
        for table, model in by_table.items()
    }
    # fleet.footprint's facts of model files (_unplaceable): learnt once a file's header has
    # been read, which the next safety re-read brings.
    assert {t for t, _ in used} - set(watched) == {"fleet_modelfile"}
    # xmin, PostgreSQL's system column, is a row's version (gateway.routing.Candidate.version),
    # which any write to the row changes: nothing routing decides by.
    system = {"xmin"}
    unwatched = {
        (table, column)
        for table, column in used
        if table in watched
        and column not in watched[table] + list(unchanging[table])
        and column not in system
    }
    assert unwatched == set()
    # Each read one query (none loads a field it left out, row by row), and _unplaceable two
    # more (its nodes, and the file facts).
    assert len(queries.captured_queries) == 7


def test_a_change_of_every_routed_field_reaches_the_gateway(
    front: GatewayServer, rows: dict[type[models.Model], Any]
) -> None:
    wait_for(
        lambda: "chat" in current_state().get().replicas,
        timeout=WITHIN,
        what="the rows' writes read (chat's replica held)",
    )
    changed = []
    for table in routed.routed():
        for name in table.fields:
            row = table.model._default_manager.get(pk=rows[table.model].pk)
            for model, field in routed.field_path(table.model, name):
                if not routed.never_changes(field):
                    all_read()  # the last change's read is over
                    before = current_state().get()
                    value = other_value(field, getattr(row, field.attname))
                    model._default_manager.filter(pk=row.pk).update(**{field.attname: value})
                    wait_for(
                        lambda before=before: current_state().get() is not before,
                        timeout=WITHIN,
                        what=f"the gateway to read again after {name} "
                        f"({model._meta.db_table}.{field.column}) changed",
                    )
                    changed.append(f"{model._meta.db_table}.{field.column}")
                row = model._default_manager.get(pk=row.pk)
                if field.is_relation:
                    row = getattr(row, field.name)
    assert "catalog_model.routing" in changed and "auth_user.username" in changed
    assert "fleet_node.address" in changed and "fleet_node.last_heartbeat" in changed


def test_a_heartbeat_and_other_unrouted_writes_do_not_make_it_read_again(
    front: GatewayServer, rows: dict[type[models.Model], Any]
) -> None:
    Node.objects.update(last_heartbeat=timezone.now())
    all_read()
    assert current_state().get().replicas != {}
    before = current_state().get()
    Node.objects.update(last_heartbeat=timezone.now(), agent={"version": "2"})
    Replica.objects.update(message="loading", engine_metrics={"slots": 1})
    Model.objects.update(description="another word", demand_at=timezone.now())
    Team.objects.update(name=models.F("name"))
    stays(
        lambda: current_state().get() is before,
        seconds=0.5,
        what="the gateway's state unchanged by unrouted writes",
    )


def test_ensure_makes_again_a_trigger_that_watches_the_columns_of_an_older_version(
    db: Any,
) -> None:
    name = "llmgw_routing_catalog_model_update"
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            # As an older version made it: IF NOT EXISTS would have kept it for good.
            cursor.execute(f"DROP TRIGGER {name}")
            cursor.execute(
                f"CREATE TRIGGER IF NOT EXISTS {name} AFTER UPDATE ON catalog_model "
                "WHEN OLD.name IS NOT NEW.name BEGIN "
                "UPDATE gateway_routingversion SET version = version + 1 WHERE id = 1; END"
            )
            query = "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = %s"
        else:
            cursor.execute(
                f"CREATE OR REPLACE TRIGGER {name} AFTER UPDATE ON catalog_model FOR EACH ROW "
                "WHEN (OLD.name IS DISTINCT FROM NEW.name) EXECUTE FUNCTION llmgw_routing_notify()"
            )
            query = "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = %s"

        def made() -> str:
            cursor.execute(query, [name])
            return cursor.fetchone()[0].lower()  # PostgreSQL writes "old.name" back

        assert "old.routing" not in made()
        triggers.ensure(connection)
        assert "old.routing" in made() and "old.sha256" in made()
        again = made()
        triggers.ensure(connection)  # as after every migrate: nothing to make again
        assert made() == again

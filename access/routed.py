"""What the gateway routes by, as columns: the one list that its reads select and its triggers watch.

Every name below is a field as Django's values() names it. gateway.routing (read_catalog,
read_replicas) and gateway.state (_unplaceable, read_teams) read exactly these names, and
access.triggers watches the columns `watched()` makes of them, so that a change of anything a
gateway process routes by reaches it by the database's notification. One list, so that the
reads and the triggers cannot drift apart; tests/gateway/test_routed_triggers.py changes every
field named here with a plain UPDATE and waits for a running gateway process to read again.
Keys are not here: a process reads only those changed since its last read (gateway.state.Keys).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import models

from catalog.models import Model
from fleet.models import Node, Replica
from llmgw.limitdefs import COUNTERS

from .models import Team, UserWeight

# -- catalog.Model ----------------------------------------------------------------------------
# read_catalog: the names requests ask for, and how each is served.
MODEL_ROUTING = (
    "name",
    "min_replicas",
    "max_replicas",
    "fallbacks",
    "adapters",
    "idle_timeout",
    "owner__username",
    "created_at",
    "routing",
    "canary",
    "context_length",
    "mmproj",
    "reranking",
    "engine",
)
# _unplaceable: whether an on-demand model fits on a node (fleet.footprint reads its profiles,
# its file by source and sha256, its vision projector by name and where the weights came from,
# and the context its KV cache is sized for).
MODEL_PLACING = (
    "name",
    "profiles",
    "source",
    "sha256",
    "context_length",
    "mmproj",
    "origin",
    "engine",
    "files",
)

# -- fleet.Replica ----------------------------------------------------------------------------
# read_replicas: where a model's requests can go.
REPLICA_ROUTING = ("id", "model_name", "state", "port", "node__address", "spec")
# read_replicas also picks the replicas in routing by these: not withdrawn, not failed, and of a
# model still in the catalog.
REPLICA_IN_ROUTING = ("withdrawn_at", "state", "model")

# -- fleet.Node -------------------------------------------------------------------------------
# _unplaceable: what a node has room for, and whether it is schedulable (Node.schedulable).
NODE_PLACING = (
    "memory_gb",
    "cores",
    "gpus",
    "gpu_memory_gb",
    "engine_backends",
    "engines",
    "gpu_engines",
    "cordoned",
    "lost",
    "last_heartbeat",
)
# Its address is read through its replicas (node__address above), and watched from there.
# A node's heartbeat counts only as having come at all: its first one makes the node schedulable,
# and the beats after change nothing routing sees (every beat would otherwise re-read).
NODE_SET_OR_CLEARED = ("last_heartbeat",)

# -- gateway.Team and its members ---------------------------------------------------------------
# read_teams: every team's limits (a team's limits count all its keys together).
TEAM_LIMITS = (
    "id",
    "name",
    "created_at",
    *COUNTERS,
    "models",
    "weight",
)
# No read of the gateway's selects members today (a key's team is its own team_id, read with the
# key); the table is watched since teams came (migration 0006), so a team's change of members
# makes the processes read the teams again, a few rows.
TEAM_MEMBERS = ("team", "user")

# -- gateway.UserWeight -----------------------------------------------------------------------
# read_user_weights: each person's weight in the fair queue (few rows: read whole on a change).
USER_WEIGHTS = ("user", "weight")


@dataclass(frozen=True)
class Routed:
    """One table's fields the gateway routes by."""

    model: type[models.Model]
    fields: tuple[str, ...]
    # Fields whose change counts only when they become set or cleared (NULL or not).
    set_or_cleared: tuple[str, ...] = ()


def routed() -> list[Routed]:
    """The tables, each with every field read of it (a function: Team.members.through, the
    members table, is there once the apps are loaded)."""
    return [
        Routed(Model, _once(MODEL_ROUTING + MODEL_PLACING)),
        Routed(Replica, _once(REPLICA_ROUTING + REPLICA_IN_ROUTING)),
        Routed(Node, NODE_PLACING, set_or_cleared=NODE_SET_OR_CLEARED),
        Routed(Team, TEAM_LIMITS),
        Routed(Team.members.through, TEAM_MEMBERS),
        Routed(UserWeight, USER_WEIGHTS),
    ]


@dataclass
class Watched:
    """One table's columns as the triggers watch them."""

    table: str
    columns: list[str]  # an UPDATE that changes one of these notifies
    set_or_cleared: list[str]  # ... or one that sets or clears one of these
    rows: bool  # an INSERT or a DELETE notifies (not on a table only read through a relation)


def watched() -> list[Watched]:
    """The columns the triggers watch, made from routed(). What a name watches:

    - a field: its own column;
    - a name through a relation ("owner__username", "node__address"): the relation's own column
      on the table read (owner_id, node_id), and the far field's column on the far table
      (auth_user's username, fleet_node's address). On a far table that is not routed itself
      (auth_user) only an UPDATE counts: a new user owns no model yet, and a deleted one clears
      their models' owner_id, which notifies as the models' own change;
    - the primary key, and a field set once when the row is made (auto_now_add: created_at):
      nothing, as they do not change.
    """
    tables = routed()
    found = {t.model._meta.db_table: Watched(t.model._meta.db_table, [], [], True) for t in tables}
    for table in tables:
        for name in table.fields:
            for model, field in field_path(table.model, name):
                column = field.column
                if never_changes(field) or column is None:  # None: field_path gives columns only
                    continue
                # A table read only through a relation (auth_user, for a model's owner's name).
                entry = found.setdefault(
                    model._meta.db_table, Watched(model._meta.db_table, [], [], rows=False)
                )
                if column in entry.columns + entry.set_or_cleared:
                    continue
                if name in table.set_or_cleared:
                    entry.set_or_cleared.append(column)
                else:
                    entry.columns.append(column)
    return list(found.values())


def field_path(
    model: type[models.Model], name: str
) -> list[tuple[type[models.Model], models.Field]]:
    """The fields a values() name goes through, each with its model: ("owner__username" on a
    catalog model) -> [(Model, owner), (User, username)]."""
    path = []
    for part in name.split("__"):
        field = model._meta.get_field(part)
        if not isinstance(field, models.Field) or not field.concrete:
            raise ValueError(f"{model.__name__}.{part} is not a column: routing cannot watch it")
        path.append((model, field))
        if field.is_relation:
            assert field.related_model is not None and field.related_model != "self"
            model = field.related_model
    return path


def never_changes(field: models.Field) -> bool:
    """A primary key, or a time set once when the row is made."""
    return bool(field.primary_key or getattr(field, "auto_now_add", False))


def _once(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))

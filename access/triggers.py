"""Database triggers that tell the gateway's processes that something they route by changed.

On PostgreSQL they send a `llmgw_routing` notification when the change commits (a replica's
names the replica); on SQLite they bump gateway.RoutingVersion's one row. They watch the
columns of access.routed, the list the gateway's reads select, so that only changes routing
sees fire them; and keys' own triggers stamp a key's `changed_at` and keep a deleted key's
hash, so that a process reads only the keys changed since its last read. ensure() (re)makes
them all after every migrate. The design: docs/design.md#how-the-gateway-hears-of-changes.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from llmgw.limitdefs import COUNTERS

from . import routed

CHANNEL = "llmgw_routing"
# On PostgreSQL a replica's change notifies with this and the replica's id, so that a gateway
# process reads again only the replicas named (gateway.state.Changes); every other table's
# change notifies with an empty payload: read everything again.
REPLICA_PREFIX = "replica "
REPLICA_TABLE = "fleet_replica"

# Keys are read by what changed since the last read (below), not whole as the routed tables are;
# that a key changed notifies as they do: its changed_at moves with whatever a key opens, its
# owner's is_active included.
KEYS_WATCHED = routed.Watched(
    "gateway_gatewaykey", ["key_hash", "revoked_at", "changed_at"], [], rows=True
)
# Every table and column whose change notifies: the routed ones (access.routed), and the keys.
ROUTED: list[routed.Watched] = [*routed.watched(), KEYS_WATCHED]
# The same, as (table, columns).
WATCHED: list[tuple[str, list[str]]] = [(w.table, w.columns + w.set_or_cleared) for w in ROUTED]

# SQLite writes one transaction at a time, so a shared counter costs nothing more there. On
# PostgreSQL a notification is sent instead: a counter's row lock would make two heartbeats
# updating different replicas deadlock on it.
_SQLITE_BUMP = "UPDATE gateway_routingversion SET version = version + 1 WHERE id = 1;"

# The key columns whose change a gateway process must read again. changed_at itself is among
# them so that a stale copy of the row saved whole (Django's save() writes every field) cannot
# move it back in time.
# What a key may use, and until when (access.models.LimitFields, its team and expiry), is read
# again as a revocation is.
LIMIT_COLUMNS = [*COUNTERS, "models", "weight", "team_id", "expires_at"]
KEY_COLUMNS = ["key_hash", "revoked_at", "changed_at", *LIMIT_COLUMNS]
# The user column that decides whether a user's keys open anything.
OWNER_COLUMNS = ["is_active"]
# The clock the key triggers write: to the microsecond on both databases (SQLite's %f has
# milliseconds; the zeros keep its text in the same form as Django's, so the two compare).
SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now') || '000'"
PG_NOW = "clock_timestamp()"
_KEY_TABLES = ("gateway_gatewaykey", "gateway_deletedgatewaykey", "auth_user")


def _changed(watched: routed.Watched, present: set[str], distinct: str) -> str:
    """The WHEN of a table's update trigger: a watched column that is there changed."""
    parts = [f"OLD.{c} {distinct} NEW.{c}" for c in watched.columns if c in present]
    parts += [
        f"(OLD.{c} IS NULL) <> (NEW.{c} IS NULL)" for c in watched.set_or_cleared if c in present
    ]
    return " OR ".join(parts)


def ensure(connection: Any) -> None:
    """Create the triggers (and the version row) where they are missing, and again where what
    they watch changed."""
    tables = set(connection.introspection.table_names())
    if "gateway_routingversion" not in tables:
        return  # before this app's migration: it will call this itself
    present = _columns_present(connection, tables)
    watched = [w for w in ROUTED if w.table in tables]
    keys = all(t in tables for t in _KEY_TABLES)
    if connection.vendor == "sqlite":
        _ensure_sqlite(connection, watched, present, keys=keys)
    elif connection.vendor == "postgresql":
        _ensure_postgresql(connection, watched, present, keys=keys)


def _columns_present(connection: Any, tables: set[str]) -> dict[str, set[str]]:
    """Each watched table's columns as the database has them now."""
    # ensure() runs after every migrate, also from migrations that come before some of the
    # columns: a column a later migration adds is watched from that migration on.
    with connection.cursor() as cursor:
        return {
            w.table: {
                c.name for c in connection.introspection.get_table_description(cursor, w.table)
            }
            for w in ROUTED
            if w.table in tables
        }


def _ensure_sqlite(
    connection: Any, watched: list[routed.Watched], present: dict[str, set[str]], *, keys: bool
) -> None:
    # One transaction: no write between a trigger dropped and made again goes unnoticed.
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        cursor.execute("INSERT OR IGNORE INTO gateway_routingversion (id, version) VALUES (1, 0)")
        for w in watched:
            _sqlite_routing_triggers(cursor, w, present[w.table])
        if keys:
            _sqlite_key_triggers(cursor, _key_columns(present))


def _sqlite_routing_triggers(cursor: Any, w: routed.Watched, present: set[str]) -> None:
    """One table's triggers that bump the version: on a row added or deleted, and on an update
    of a watched column."""
    name = f"llmgw_routing_{w.table}"
    for event in ("INSERT", "DELETE"):
        _sqlite_trigger(
            cursor,
            f"{name}_{event.lower()}",
            f"AFTER {event} ON {w.table} BEGIN {_SQLITE_BUMP} END" if w.rows else None,
        )
    when = _changed(w, present, "IS NOT")
    _sqlite_trigger(
        cursor,
        f"{name}_update",
        f"AFTER UPDATE ON {w.table} WHEN {when} BEGIN {_SQLITE_BUMP} END" if when else None,
    )


def _ensure_postgresql(
    connection: Any, watched: list[routed.Watched], present: dict[str, set[str]], *, keys: bool
) -> None:
    # CREATE OR REPLACE: a trigger made by an older version is replaced by today's. One
    # transaction, as on SQLite: no write between a trigger dropped and made again.
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO gateway_routingversion (id, version) VALUES (1, 0) "
            "ON CONFLICT (id) DO NOTHING"
        )
        _postgresql_notify_functions(cursor)
        for w in watched:
            _postgresql_routing_triggers(cursor, w, present[w.table])
        if keys:
            _postgresql_key_triggers(cursor, _key_columns(present))


def _postgresql_notify_functions(cursor: Any) -> None:
    cursor.execute(
        "CREATE OR REPLACE FUNCTION llmgw_routing_notify() RETURNS trigger AS $$ "
        f"BEGIN PERFORM pg_notify('{CHANNEL}', ''); RETURN NULL; END $$ LANGUAGE plpgsql"
    )
    # A replica's notification names it (one a row; PostgreSQL sends one of each payload a
    # transaction, however often the row changed in it).
    cursor.execute(
        "CREATE OR REPLACE FUNCTION llmgw_routing_notify_replica() RETURNS trigger AS $$ "
        f"BEGIN PERFORM pg_notify('{CHANNEL}', '{REPLICA_PREFIX}' || "
        "CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END::text); "
        "RETURN NULL; END $$ LANGUAGE plpgsql"
    )


def _postgresql_routing_triggers(cursor: Any, w: routed.Watched, present: set[str]) -> None:
    """One table's triggers that notify: on rows added or deleted, and on an update of a
    watched column; a replica's row by row, naming it, any other table's once a statement."""
    name = f"llmgw_routing_{w.table}"
    by_row = w.table == REPLICA_TABLE
    function = "llmgw_routing_notify_replica" if by_row else "llmgw_routing_notify"
    if w.rows:
        # (A trigger's level cannot be replaced: one made by a statement before replicas were
        # named goes first.)
        cursor.execute(f"DROP TRIGGER IF EXISTS {name}_insert_delete ON {w.table}")
        cursor.execute(
            f"CREATE TRIGGER {name}_insert_delete "
            f"AFTER INSERT OR DELETE ON {w.table} "
            f"FOR EACH {'ROW' if by_row else 'STATEMENT'} EXECUTE FUNCTION {function}()"
        )
    when = _changed(w, present, "IS DISTINCT FROM")
    if when:
        cursor.execute(
            f"CREATE OR REPLACE TRIGGER {name}_update AFTER UPDATE "
            f"ON {w.table} FOR EACH ROW WHEN ({when}) "
            f"EXECUTE FUNCTION {function}()"
        )


def _sqlite_trigger(cursor: Any, name: str, body: str | None) -> None:
    """Make SQLite trigger `name` as `body` says (None: no such trigger), replacing one made
    otherwise: CREATE TRIGGER IF NOT EXISTS would keep watching the columns of the version that
    first made it."""
    cursor.execute("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = %s", [name])
    found = cursor.fetchone()
    wanted = f"CREATE TRIGGER {name} {body}" if body is not None else None
    if (found[0] if found else None) == wanted:
        return
    cursor.execute(f"DROP TRIGGER IF EXISTS {name}")
    if wanted is not None:
        cursor.execute(wanted)


def _key_columns(present: dict[str, set[str]]) -> list[str]:
    # Migration 0005 makes the key triggers before 0006 adds the limit columns: each migration
    # watches the columns there are by then, and 0006 makes them again.
    return [c for c in KEY_COLUMNS if c in present["gateway_gatewaykey"]]


def _distinct(columns: list[str], operator: str) -> str:
    return " OR ".join(f"OLD.{c} {operator} NEW.{c}" for c in columns)


def _sqlite_key_triggers(cursor: Any, key_columns: list[str]) -> None:
    # SQLite cannot change NEW in a BEFORE trigger: the row is updated again after. With
    # recursive triggers off (SQLite's default), that second update fires nothing.
    stamp = f"UPDATE gateway_gatewaykey SET changed_at = {SQLITE_NOW} WHERE id = NEW.id;"
    # A key whose hash changed no longer opens anything by its old hash: that hash is gone.
    old_hash_gone = (
        "INSERT INTO gateway_deletedgatewaykey (key_hash, deleted_at) "
        f"SELECT OLD.key_hash, {SQLITE_NOW} WHERE OLD.key_hash IS NOT NEW.key_hash;"
    )
    _sqlite_trigger(
        cursor, "llmgw_keys_insert", f"AFTER INSERT ON gateway_gatewaykey BEGIN {stamp} END"
    )
    _sqlite_trigger(
        cursor,
        "llmgw_keys_update",
        "AFTER UPDATE ON gateway_gatewaykey "
        f"WHEN {_distinct(key_columns, 'IS NOT')} BEGIN {stamp} {old_hash_gone} END",
    )
    _sqlite_trigger(
        cursor,
        "llmgw_keys_delete",
        "AFTER DELETE ON gateway_gatewaykey BEGIN INSERT INTO gateway_deletedgatewaykey "
        f"(key_hash, deleted_at) VALUES (OLD.key_hash, {SQLITE_NOW}); END",
    )
    _sqlite_trigger(
        cursor,
        "llmgw_keys_owner",
        f"AFTER UPDATE ON auth_user WHEN {_distinct(OWNER_COLUMNS, 'IS NOT')} "
        f"BEGIN UPDATE gateway_gatewaykey SET changed_at = {SQLITE_NOW} WHERE owner_id = NEW.id; END",
    )


def _postgresql_key_triggers(cursor: Any, key_columns: list[str]) -> None:
    # A key whose hash changed no longer opens anything by its old hash: that hash is gone.
    cursor.execute(
        "CREATE OR REPLACE FUNCTION llmgw_keys_stamp() RETURNS trigger AS $$ "
        f"BEGIN NEW.changed_at := {PG_NOW}; "
        "IF TG_OP = 'UPDATE' AND OLD.key_hash IS DISTINCT FROM NEW.key_hash THEN "
        "INSERT INTO gateway_deletedgatewaykey (key_hash, deleted_at) "
        f"VALUES (OLD.key_hash, {PG_NOW}); END IF; "
        "RETURN NEW; END $$ LANGUAGE plpgsql"
    )
    cursor.execute(
        "CREATE OR REPLACE TRIGGER llmgw_keys_insert BEFORE INSERT ON gateway_gatewaykey "
        "FOR EACH ROW EXECUTE FUNCTION llmgw_keys_stamp()"
    )
    cursor.execute(
        "CREATE OR REPLACE TRIGGER llmgw_keys_update BEFORE UPDATE ON gateway_gatewaykey "
        f"FOR EACH ROW WHEN ({_distinct(key_columns, 'IS DISTINCT FROM')}) "
        "EXECUTE FUNCTION llmgw_keys_stamp()"
    )
    # One statement deleting a user's thousand keys writes their hashes in one insert.
    cursor.execute(
        "CREATE OR REPLACE FUNCTION llmgw_keys_deleted() RETURNS trigger AS $$ "
        "BEGIN INSERT INTO gateway_deletedgatewaykey (key_hash, deleted_at) "
        f"SELECT key_hash, {PG_NOW} FROM gone; RETURN NULL; END $$ LANGUAGE plpgsql"
    )
    cursor.execute(
        "CREATE OR REPLACE TRIGGER llmgw_keys_delete AFTER DELETE ON gateway_gatewaykey "
        "REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION llmgw_keys_deleted()"
    )
    cursor.execute(
        "CREATE OR REPLACE FUNCTION llmgw_keys_owner() RETURNS trigger AS $$ "
        f"BEGIN UPDATE gateway_gatewaykey SET changed_at = {PG_NOW} WHERE owner_id = NEW.id; "
        "RETURN NULL; END $$ LANGUAGE plpgsql"
    )
    cursor.execute(
        "CREATE OR REPLACE TRIGGER llmgw_keys_owner AFTER UPDATE ON auth_user "
        f"FOR EACH ROW WHEN ({_distinct(OWNER_COLUMNS, 'IS DISTINCT FROM')}) "
        "EXECUTE FUNCTION llmgw_keys_owner()"
    )


_KEY_TRIGGERS = [
    ("llmgw_keys_insert", "gateway_gatewaykey"),
    ("llmgw_keys_update", "gateway_gatewaykey"),
    ("llmgw_keys_delete", "gateway_gatewaykey"),
    ("llmgw_keys_owner", "auth_user"),
]


def drop_key_triggers(connection: Any) -> None:
    """Undo migration 0005's part: the key triggers."""
    with connection.cursor() as cursor:
        for name, table in _KEY_TRIGGERS:
            if connection.vendor == "sqlite":
                cursor.execute(f"DROP TRIGGER IF EXISTS {name}")
            elif connection.vendor == "postgresql":
                cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
        if connection.vendor == "postgresql":
            for function in ("llmgw_keys_stamp", "llmgw_keys_deleted", "llmgw_keys_owner"):
                cursor.execute(f"DROP FUNCTION IF EXISTS {function}()")


def drop(connection: Any) -> None:
    drop_key_triggers(connection)
    with connection.cursor() as cursor:
        for w in ROUTED:
            if connection.vendor == "sqlite":
                for event in ("insert", "delete", "update"):
                    cursor.execute(f"DROP TRIGGER IF EXISTS llmgw_routing_{w.table}_{event}")
            elif connection.vendor == "postgresql":
                for name in ("insert_delete", "update"):
                    cursor.execute(
                        f"DROP TRIGGER IF EXISTS llmgw_routing_{w.table}_{name} ON {w.table}"
                    )
        if connection.vendor == "postgresql":
            cursor.execute("DROP FUNCTION IF EXISTS llmgw_routing_notify()")
            cursor.execute("DROP FUNCTION IF EXISTS llmgw_routing_notify_replica()")

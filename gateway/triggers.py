"""Database triggers that tell the gateway's processes that something they route by changed.

On SQLite they bump gateway.RoutingVersion's one row (SQLite writes one
transaction at a time, so a shared counter costs nothing more); on PostgreSQL
they send a `llmgw_routing` notification, delivered when the change commits,
without the row lock a shared counter would take (two heartbeats updating
different replicas would then deadlock on it).

Only changes that routing sees fire them: a heartbeat that writes a replica's
message or a node's last heartbeat does not, nor a model's idle clock.

Teams (their limits, and their members table) are watched as the routed tables
are: the gateway reads every team again when one changes.

Keys carry a second set of triggers (from migration 0005), so that a gateway
process reads only the keys that changed since its last read:

- a key's `changed_at` is set by the database, to its own clock, when the key
  is added, when its hash, revocation, limits, team or expiry change, and, for all of a user's keys,
  when the user's is_active changes: a deactivated user's gateway keys stop as
  their API token and console login do, whichever door deactivated them (the
  admin and a shell write the row directly, where a Django signal could be
  missed). That change of changed_at is what notifies the gateway;
- a deleted key (keys are deleted with their owner) leaves its hash in
  gateway.DeletedGatewayKey, and so does a key's old hash when its hash changes.

Why the database's clock, and the time of the write rather than of the commit:
see gateway.state.key_horizon, which says up to when a process has read
everything.

On SQLite, a later migration that alters one of these tables rebuilds it and
loses its triggers, so they are (re)made after every migrate, not only by the
migration that introduced them.
"""

from __future__ import annotations

from typing import Any

CHANNEL = "llmgw_routing"

# (table, columns whose change matters to routing)
WATCHED: list[tuple[str, list[str]]] = [
    (
        "catalog_model",
        [
            "name",
            "min_replicas",
            "max_replicas",
            "fallbacks",
            "adapters",
            "idle_timeout",
            "owner_id",
            "profiles",
            "canary",
        ],
    ),
    (
        "fleet_replica",
        ["state", "port", "withdrawn_at", "model_id", "model_name", "node_id", "spec"],
    ),
    ("fleet_node", ["address", "memory_gb", "cores", "gpus", "gpu_memory_gb", "cordoned", "lost"]),
    # changed_at moves with what a key opens, its owner's is_active included (below).
    ("gateway_gatewaykey", ["key_hash", "revoked_at", "changed_at"]),
    # A team's limits count all its keys together: the gateway reads teams whole (few rows).
    (
        "gateway_team",
        [
            "name",
            "rpm",
            "tpm",
            "max_parallel",
            "tokens_per_day",
            "tokens_per_month",
            "models",
            "weight",
        ],
    ),
    ("gateway_team_members", ["team_id", "user_id"]),
]
# A node's first heartbeat makes it schedulable: watched as "became set", not every beat.
SET_OR_CLEARED = {"fleet_node": ["last_heartbeat"]}

_SQLITE_BUMP = "UPDATE gateway_routingversion SET version = version + 1 WHERE id = 1;"

# The key columns whose change a gateway process must read again. changed_at itself is among
# them so that a stale copy of the row saved whole (Django's save() writes every field) cannot
# move it back in time.
# What a key may use, and until when (gateway.models.LimitFields, its team and expiry), is read
# again as a revocation is.
LIMIT_COLUMNS = ["rpm", "tpm", "max_parallel", "tokens_per_day", "tokens_per_month", "models"]
LIMIT_COLUMNS += ["weight", "team_id", "expires_at"]
KEY_COLUMNS = ["key_hash", "revoked_at", "changed_at", *LIMIT_COLUMNS]
# The user column that decides whether a user's keys open anything.
OWNER_COLUMNS = ["is_active"]
# The clock the key triggers write: to the microsecond on both databases (SQLite's %f has
# milliseconds; the zeros keep its text in the same form as Django's, so the two compare).
SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now') || '000'"
PG_NOW = "clock_timestamp()"
_KEY_TABLES = ("gateway_gatewaykey", "gateway_deletedgatewaykey", "auth_user")


def _changed(table: str, columns: list[str], distinct: str) -> str:
    parts = [f"OLD.{c} {distinct} NEW.{c}" for c in columns]
    parts += [f"(OLD.{c} IS NULL) <> (NEW.{c} IS NULL)" for c in SET_OR_CLEARED.get(table, [])]
    return " OR ".join(parts)


def ensure(connection: Any) -> None:
    """Create the triggers (and the version row) where they are missing."""
    tables = set(connection.introspection.table_names())
    if "gateway_routingversion" not in tables:
        return  # before this app's migration: it will call this itself
    with connection.cursor() as cursor:
        # A column a later migration adds (a key's changed_at) is watched from that migration on.
        present = {
            table: {c.name for c in connection.introspection.get_table_description(cursor, table)}
            for table, _ in WATCHED
            if table in tables
        }
        watched = [
            (table, [c for c in columns if c in present[table]])
            for table, columns in WATCHED
            if table in tables
        ]
        if connection.vendor == "sqlite":
            cursor.execute(
                "INSERT OR IGNORE INTO gateway_routingversion (id, version) VALUES (1, 0)"
            )
            for table, columns in watched:
                for event in ("INSERT", "DELETE"):
                    cursor.execute(
                        f"CREATE TRIGGER IF NOT EXISTS llmgw_routing_{table}_{event.lower()} "
                        f"AFTER {event} ON {table} BEGIN {_SQLITE_BUMP} END"
                    )
                cursor.execute(
                    f"CREATE TRIGGER IF NOT EXISTS llmgw_routing_{table}_update AFTER UPDATE "
                    f"ON {table} WHEN {_changed(table, columns, 'IS NOT')} BEGIN {_SQLITE_BUMP} END"
                )
            if all(t in tables for t in _KEY_TABLES):
                _sqlite_key_triggers(cursor, _key_columns(present))
        elif connection.vendor == "postgresql":
            cursor.execute(
                "INSERT INTO gateway_routingversion (id, version) VALUES (1, 0) "
                "ON CONFLICT (id) DO NOTHING"
            )
            cursor.execute(
                "CREATE OR REPLACE FUNCTION llmgw_routing_notify() RETURNS trigger AS $$ "
                f"BEGIN PERFORM pg_notify('{CHANNEL}', ''); RETURN NULL; END $$ LANGUAGE plpgsql"
            )
            for table, columns in watched:
                cursor.execute(
                    f"CREATE OR REPLACE TRIGGER llmgw_routing_{table}_insert_delete "
                    f"AFTER INSERT OR DELETE ON {table} "
                    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_routing_notify()"
                )
                cursor.execute(
                    f"CREATE OR REPLACE TRIGGER llmgw_routing_{table}_update AFTER UPDATE "
                    f"ON {table} FOR EACH ROW "
                    f"WHEN ({_changed(table, columns, 'IS DISTINCT FROM')}) "
                    "EXECUTE FUNCTION llmgw_routing_notify()"
                )
            if all(t in tables for t in _KEY_TABLES):
                _postgresql_key_triggers(cursor, _key_columns(present))


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
    cursor.execute(
        "CREATE TRIGGER IF NOT EXISTS llmgw_keys_insert AFTER INSERT ON gateway_gatewaykey "
        f"BEGIN {stamp} END"
    )
    cursor.execute(
        "CREATE TRIGGER IF NOT EXISTS llmgw_keys_update AFTER UPDATE ON gateway_gatewaykey "
        f"WHEN {_distinct(key_columns, 'IS NOT')} BEGIN {stamp} {old_hash_gone} END"
    )
    cursor.execute(
        "CREATE TRIGGER IF NOT EXISTS llmgw_keys_delete AFTER DELETE ON gateway_gatewaykey "
        "BEGIN INSERT INTO gateway_deletedgatewaykey (key_hash, deleted_at) "
        f"VALUES (OLD.key_hash, {SQLITE_NOW}); END"
    )
    cursor.execute(
        "CREATE TRIGGER IF NOT EXISTS llmgw_keys_owner AFTER UPDATE ON auth_user "
        f"WHEN {_distinct(OWNER_COLUMNS, 'IS NOT')} BEGIN UPDATE gateway_gatewaykey "
        f"SET changed_at = {SQLITE_NOW} WHERE owner_id = NEW.id; END"
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
        for table, _ in WATCHED:
            if connection.vendor == "sqlite":
                for event in ("insert", "delete", "update"):
                    cursor.execute(f"DROP TRIGGER IF EXISTS llmgw_routing_{table}_{event}")
            elif connection.vendor == "postgresql":
                for name in ("insert_delete", "update"):
                    cursor.execute(
                        f"DROP TRIGGER IF EXISTS llmgw_routing_{table}_{name} ON {table}"
                    )
        if connection.vendor == "postgresql":
            cursor.execute("DROP FUNCTION IF EXISTS llmgw_routing_notify()")

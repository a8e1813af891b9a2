"""Database triggers that tell the gateway's processes that something they route by changed.

On SQLite they bump gateway.RoutingVersion's one row (SQLite writes one
transaction at a time, so a shared counter costs nothing more); on PostgreSQL
they send a `llmgw_routing` notification, delivered when the change commits,
without the row lock a shared counter would take (two heartbeats updating
different replicas would then deadlock on it).

Only changes that routing sees fire them: a heartbeat that writes a replica's
message or a node's last heartbeat does not, nor a model's idle clock.

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
    ("gateway_gatewaykey", ["key_hash", "revoked_at"]),
]
# A node's first heartbeat makes it schedulable: watched as "became set", not every beat.
SET_OR_CLEARED = {"fleet_node": ["last_heartbeat"]}

_SQLITE_BUMP = "UPDATE gateway_routingversion SET version = version + 1 WHERE id = 1;"


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
        if connection.vendor == "sqlite":
            cursor.execute(
                "INSERT OR IGNORE INTO gateway_routingversion (id, version) VALUES (1, 0)"
            )
            for table, columns in WATCHED:
                if table not in tables:
                    continue
                for event in ("INSERT", "DELETE"):
                    cursor.execute(
                        f"CREATE TRIGGER IF NOT EXISTS llmgw_routing_{table}_{event.lower()} "
                        f"AFTER {event} ON {table} BEGIN {_SQLITE_BUMP} END"
                    )
                cursor.execute(
                    f"CREATE TRIGGER IF NOT EXISTS llmgw_routing_{table}_update AFTER UPDATE "
                    f"ON {table} WHEN {_changed(table, columns, 'IS NOT')} BEGIN {_SQLITE_BUMP} END"
                )
        elif connection.vendor == "postgresql":
            cursor.execute(
                "INSERT INTO gateway_routingversion (id, version) VALUES (1, 0) "
                "ON CONFLICT (id) DO NOTHING"
            )
            cursor.execute(
                "CREATE OR REPLACE FUNCTION llmgw_routing_notify() RETURNS trigger AS $$ "
                f"BEGIN PERFORM pg_notify('{CHANNEL}', ''); RETURN NULL; END $$ LANGUAGE plpgsql"
            )
            for table, columns in WATCHED:
                if table not in tables:
                    continue
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


def drop(connection: Any) -> None:
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

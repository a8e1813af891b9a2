"""core.env: settings read from the environment."""

from __future__ import annotations

from pathlib import Path

from core.env import database_from_url


def test_it_checks_kept_postgresql_connections_before_reusing_them() -> None:
    # After a PostgreSQL restart a kept connection is dead: checked, it is replaced instead of
    # failing the request that reuses it.
    settings = database_from_url("postgres://u:p@db.example:5433/llmgw", base_dir=Path("/srv"))
    assert settings["CONN_MAX_AGE"] == 60
    assert settings["CONN_HEALTH_CHECKS"] is True
    assert (settings["HOST"], settings["PORT"], settings["NAME"]) == ("db.example", "5433", "llmgw")

"""What the catalog's migrations do about the routing triggers (access.triggers) that watch
catalog_model's columns.

Taking a migration that added a watched column back drops that column, and SQLite refuses to
drop a column a trigger names ("error in trigger ... no such column"); PostgreSQL drops the
trigger with it. So on SQLite the table's triggers go first: the next `migrate` makes them again
(access's post_migrate), watching the columns then present.
"""

from __future__ import annotations

from typing import Any


def drop_model_triggers(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "sqlite":
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'catalog_model'"
        )
        for (name,) in cursor.fetchall():
            cursor.execute(f'DROP TRIGGER IF EXISTS "{name}"')

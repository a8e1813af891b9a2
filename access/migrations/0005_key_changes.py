"""Incremental key reads: a key's changed_at (set by the database), deleted keys' hashes, and
the triggers that keep both; a user's is_active counts as a change of their keys."""

import django.utils.timezone
from django.db import migrations, models


def create(apps, schema_editor):
    # When the migration runs, not when Django loads the migration graph.
    from access import triggers

    connection = schema_editor.connection
    if connection.vendor == "sqlite":
        # Made with CREATE TRIGGER IF NOT EXISTS: the key table's routing trigger of 0002 would
        # stay as it was, not watching changed_at (the table rebuild above usually dropped it).
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS llmgw_routing_gateway_gatewaykey_update")
    triggers.ensure(connection)


def drop(apps, schema_editor):
    # When the migration runs, not when Django loads the migration graph.
    from access import triggers

    triggers.drop_key_triggers(schema_editor.connection)


class Migration(migrations.Migration):
    replaces = [("gateway", "0005_key_changes")]  # made by the gateway app, before it moved here
    dependencies = [
        ("access", "0004_traffic_revision"),
    ]

    operations = [
        migrations.AddField(
            model_name="gatewaykey",
            name="changed_at",
            field=models.DateTimeField(
                db_index=True, default=django.utils.timezone.now, editable=False
            ),
        ),
        migrations.CreateModel(
            name="DeletedGatewayKey",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key_hash", models.CharField(max_length=64)),
                (
                    "deleted_at",
                    models.DateTimeField(db_index=True, default=django.utils.timezone.now),
                ),
            ],
            options={
                "db_table": "gateway_deletedgatewaykey",
            },
        ),
        migrations.RunPython(create, drop),
    ]

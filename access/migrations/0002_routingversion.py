"""The routing version row, and the triggers that bump it (SQLite) or notify (PostgreSQL)."""

from django.db import migrations, models


def create(apps, schema_editor):
    # When the migration runs, not when Django loads the migration graph.
    from access import triggers

    triggers.ensure(schema_editor.connection)


def drop(apps, schema_editor):
    # When the migration runs, not when Django loads the migration graph.
    from access import triggers

    triggers.drop(schema_editor.connection)


class Migration(migrations.Migration):
    replaces = [("gateway", "0002_routingversion")]  # made by the gateway app, before it moved here
    dependencies = [
        ("access", "0001_initial"),
        ("catalog", "0004_model_origin_model_previous_model_update_available_and_more"),
        ("fleet", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="RoutingVersion",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("version", models.BigIntegerField(default=0)),
            ],
            options={
                "db_table": "gateway_routingversion",
            },
        ),
        migrations.RunPython(create, drop),
    ]

"""Teams, and the limits of keys and teams (access.models.LimitFields), a key's team and expiry.

The key triggers watch the new columns, and the routing triggers the team tables. They are
dropped before the columns change and made again after: PostgreSQL will not drop a column a
trigger's WHEN names, and SQLite's CREATE TRIGGER IF NOT EXISTS would keep the old ones.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

import access.models


def drop_key_triggers(apps, schema_editor):
    # When the migration runs, not when Django loads the migration graph.
    from access import triggers

    connection = schema_editor.connection
    triggers.drop_key_triggers(connection)
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS llmgw_routing_gateway_gatewaykey_update")


def make_triggers(apps, schema_editor):
    # When the migration runs, not when Django loads the migration graph.
    from access import triggers

    triggers.ensure(schema_editor.connection)


class Migration(migrations.Migration):
    replaces = [
        ("gateway", "0006_teams_and_limits")
    ]  # made by the gateway app, before it moved here
    dependencies = [
        ("access", "0005_key_changes"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RunPython(drop_key_triggers, make_triggers),
        migrations.AddField(
            model_name="gatewaykey",
            name="expires_at",
            field=models.DateTimeField(
                blank=True, help_text="after this the key opens nothing; blank for never", null=True
            ),
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="max_parallel",
            field=models.PositiveBigIntegerField(
                blank=True, help_text="requests in flight at once; blank for no limit", null=True
            ),
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="models",
            field=models.JSONField(
                blank=True,
                default=list,
                help_text="names or globs (fnmatch: *, ?, [...]) of the models and adapters it may use; empty for every model",
            ),
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="rpm",
            field=models.PositiveBigIntegerField(
                blank=True, help_text="requests per minute; blank for no limit", null=True
            ),
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="tokens_per_day",
            field=models.PositiveBigIntegerField(
                blank=True,
                help_text="prompt + completion tokens per day (UTC, from midnight); blank for no limit",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="tokens_per_month",
            field=models.PositiveBigIntegerField(
                blank=True,
                help_text="prompt + completion tokens per calendar month (UTC, from the 1st); blank for no limit",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="tpm",
            field=models.PositiveBigIntegerField(
                blank=True,
                help_text="tokens per minute: prompt + completion tokens as the engine reports them; a stream counts when it ends. Blank for no limit",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="weight",
            field=models.FloatField(
                default=1.0,
                help_text="its share of a model's slots when requests queue for them (fair queueing): a weight of 2 gets twice the slots of a weight of 1",
            ),
        ),
        migrations.CreateModel(
            name="Team",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "rpm",
                    models.PositiveBigIntegerField(
                        blank=True, help_text="requests per minute; blank for no limit", null=True
                    ),
                ),
                (
                    "tpm",
                    models.PositiveBigIntegerField(
                        blank=True,
                        help_text="tokens per minute: prompt + completion tokens as the engine reports them; a stream counts when it ends. Blank for no limit",
                        null=True,
                    ),
                ),
                (
                    "max_parallel",
                    models.PositiveBigIntegerField(
                        blank=True,
                        help_text="requests in flight at once; blank for no limit",
                        null=True,
                    ),
                ),
                (
                    "tokens_per_day",
                    models.PositiveBigIntegerField(
                        blank=True,
                        help_text="prompt + completion tokens per day (UTC, from midnight); blank for no limit",
                        null=True,
                    ),
                ),
                (
                    "tokens_per_month",
                    models.PositiveBigIntegerField(
                        blank=True,
                        help_text="prompt + completion tokens per calendar month (UTC, from the 1st); blank for no limit",
                        null=True,
                    ),
                ),
                (
                    "weight",
                    models.FloatField(
                        default=1.0,
                        help_text="its share of a model's slots when requests queue for them (fair queueing): a weight of 2 gets twice the slots of a weight of 1",
                    ),
                ),
                (
                    "models",
                    models.JSONField(
                        blank=True,
                        default=list,
                        help_text="names or globs (fnmatch: *, ?, [...]) of the models and adapters it may use; empty for every model",
                    ),
                ),
                (
                    "name",
                    models.CharField(
                        max_length=100, unique=True, validators=[access.models.validate_team_name]
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "members",
                    models.ManyToManyField(
                        blank=True, related_name="llmgw_teams", to=settings.AUTH_USER_MODEL
                    ),
                ),
            ],
            options={
                "db_table": "gateway_team",
                "ordering": ["name"],
            },
        ),
        migrations.AddField(
            model_name="gatewaykey",
            name="team",
            field=models.ForeignKey(
                blank=True,
                help_text="whose limits it also counts against, over all the team's keys together",
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="keys",
                to="access.team",
            ),
        ),
        migrations.RunPython(make_triggers, drop_key_triggers),
    ]

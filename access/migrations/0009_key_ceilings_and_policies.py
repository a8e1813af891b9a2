"""Ceilings on keys, and key policies (access.policies); what staff set on keys becomes their
ceilings.

Which of a key's figures staff set is read from the audit: a key's owner changes only their own
keys, so an entry of `key-limits` whose actor is not the key's owner (the record names the owner
at the time) was made by staff. The last setter of each setting decides: when it was staff, and
the key still holds what they set, that figure becomes the key's ceiling. A key's limits
themselves are not changed.

On SQLite adding the column rebuilds the key table, and a trigger of another table that names it
(a user's is_active moves their keys' changed_at) fails the rebuild: the key triggers are dropped
before the column changes and made again after, as in 0006.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

# What a ceiling on a key may hold (access.policies.KEY_CEILINGS), as the audit records them.
SETTINGS = ["rpm", "tpm", "max_parallel", "tokens_per_day", "tokens_per_month"]
SETTINGS += ["weight", "models", "expires_at"]
SUBJECT = "key #"
CHUNK = 500


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


def record_staff_ceilings(apps, schema_editor):
    AuditEntry = apps.get_model("catalog", "AuditEntry")
    GatewayKey = apps.get_model("access", "GatewayKey")
    # Each key's settings whose last setter was staff, with what they set.
    staff_set: dict[int, dict[str, object]] = {}
    entries = AuditEntry.objects.filter(action="key-limits", model_name__startswith=SUBJECT)
    for entry in entries.order_by("at", "id").iterator(chunk_size=2000):
        number = entry.model_name[len(SUBJECT) :]
        if not number.isdigit():
            continue
        after = entry.after or {}
        by_staff = entry.actor_name != after.get("owner")
        figures = staff_set.setdefault(int(number), {})
        for name in entry.changes or {}:
            if name not in SETTINGS:
                continue
            if by_staff:
                figures[name] = after.get(name)
            else:
                figures.pop(name, None)
    ids = sorted(key_id for key_id, figures in staff_set.items() if figures)
    for start in range(0, len(ids), CHUNK):
        for key in GatewayKey.objects.filter(pk__in=ids[start : start + CHUNK]):
            ceilings = {}
            for name, figure in staff_set[key.pk].items():
                held = getattr(key, name)
                if name == "expires_at" and held is not None:
                    held = held.isoformat()
                # Lifted by staff (none, every model) is no ceiling; changed since, outside the
                # audit, is not what staff set.
                if figure is not None and figure != [] and held == figure:
                    ceilings[name] = figure
            if ceilings:
                key.ceilings = ceilings
                key.save(update_fields=["ceilings"])


class Migration(migrations.Migration):
    replaces = [
        ("gateway", "0009_key_ceilings_and_policies")
    ]  # made by the gateway app, before it moved here
    dependencies = [
        ("access", "0008_traffic_slowest_request"),
        ("catalog", "0008_auditentry_trace_id"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RunPython(drop_key_triggers, make_triggers),
        migrations.AddField(
            model_name="gatewaykey",
            name="ceilings",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="what staff set on the key: its owner may lower these and never raise them",
            ),
        ),
        migrations.CreateModel(
            name="KeyPolicy",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("default", "every user's keys in no team"),
                            ("team", "a team"),
                            ("user", "a user"),
                        ],
                        max_length=10,
                    ),
                ),
                (
                    "defaults",
                    models.JSONField(
                        blank=True,
                        default=dict,
                        help_text="what a new key gets of each limit not given",
                    ),
                ),
                (
                    "ceilings",
                    models.JSONField(
                        blank=True,
                        default=dict,
                        help_text="the most a key's owner may set each limit to",
                    ),
                ),
                ("changed_at", models.DateTimeField(auto_now=True)),
                (
                    "team",
                    models.OneToOneField(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="key_policy",
                        to="access.team",
                    ),
                ),
                (
                    "user",
                    models.OneToOneField(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="llmgw_key_policy",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "db_table": "gateway_keypolicy",
                "verbose_name": "key policy",
                "verbose_name_plural": "key policies",
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(
                                ("kind", "default"), ("team__isnull", True), ("user__isnull", True)
                            ),
                            models.Q(
                                ("kind", "team"), ("team__isnull", False), ("user__isnull", True)
                            ),
                            models.Q(
                                ("kind", "user"), ("team__isnull", True), ("user__isnull", False)
                            ),
                            _connector="OR",
                        ),
                        name="key_policy_one_scope",
                    ),
                    models.UniqueConstraint(
                        condition=models.Q(("kind", "default")),
                        fields=("kind",),
                        name="key_policy_one_default",
                    ),
                ],
            },
        ),
        migrations.RunPython(record_staff_ceilings, migrations.RunPython.noop),
        migrations.RunPython(make_triggers, drop_key_triggers),
    ]

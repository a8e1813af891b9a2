"""Fetch, MirrorFile and Rollout move here from the catalog app, rows and history included.

Nothing is copied: the models keep their tables (catalog_fetch, catalog_mirrorfile,
catalog_rollout), so only Django's idea of which app owns them changes (the state
operations below, and catalog 0007 deleting them from the catalog's state). Their
content types are renamed to this app rather than created anew, so admin history
(LogEntry) and permissions granted on them point at the same rows as before, and
nothing is left for stale content type removal to delete.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

MOVED = ("fetch", "mirrorfile", "rollout")


def _move_content_types(apps, schema_editor, *, from_app: str, to_app: str) -> None:
    ContentType = apps.get_model("contenttypes", "ContentType")
    LogEntry = apps.get_model("admin", "LogEntry")
    Permission = apps.get_model("auth", "Permission")
    db = schema_editor.connection.alias
    for name in MOVED:
        old = ContentType.objects.using(db).filter(app_label=from_app, model=name).first()
        if old is None:
            continue  # a fresh database: post_migrate creates them under their new app
        # A row under the new label exists only if the new code asked for it before this
        # migration ran (get_for_model creates what it does not find): its few log entries
        # join the old row, which keeps the history and the permissions granted on it.
        new = ContentType.objects.using(db).filter(app_label=to_app, model=name).first()
        if new is not None:
            LogEntry.objects.using(db).filter(content_type=new).update(content_type=old)
            Permission.objects.using(db).filter(content_type=new).delete()
            new.delete()
        old.app_label = to_app
        old.save(update_fields=["app_label"])
    # The real model, not the historical one: its cache is the one the running process keeps.
    from django.contrib.contenttypes.models import ContentType as CachedContentType

    CachedContentType.objects.clear_cache()


def forwards(apps, schema_editor):
    _move_content_types(apps, schema_editor, from_app="catalog", to_app="registry")


def backwards(apps, schema_editor):
    _move_content_types(apps, schema_editor, from_app="registry", to_app="catalog")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("catalog", "0006_model_canary"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("admin", "0003_logentry_add_action_flag_choices"),
        ("auth", "0012_alter_user_first_name_max_length"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="Fetch",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("repo", models.CharField(max_length=200)),
                        ("branch", models.CharField(default="main", max_length=200)),
                        ("commit", models.CharField(max_length=64)),
                        ("files", models.JSONField(default=list)),
                        (
                            "state",
                            models.CharField(
                                choices=[
                                    ("queued", "queued"),
                                    ("running", "running"),
                                    ("done", "done"),
                                    ("failed", "failed"),
                                ],
                                db_index=True,
                                default="queued",
                                max_length=10,
                            ),
                        ),
                        ("bytes_done", models.BigIntegerField(default=0)),
                        ("bytes_total", models.BigIntegerField(default=0)),
                        ("message", models.TextField(blank=True, default="")),
                        ("serve_definition", models.JSONField(blank=True, null=True)),
                        ("door", models.CharField(default="api", max_length=20)),
                        ("heartbeat_at", models.DateTimeField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("finished_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "requested_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={"db_table": "catalog_fetch"},
                ),
                migrations.CreateModel(
                    name="MirrorFile",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("repo", models.CharField(max_length=200)),
                        ("commit", models.CharField(max_length=64)),
                        ("path", models.CharField(max_length=500)),
                        ("sha256", models.CharField(max_length=64)),
                        ("size", models.BigIntegerField()),
                        ("source_url", models.CharField(max_length=2000)),
                        ("fetched_at", models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        "db_table": "catalog_mirrorfile",
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("repo", "commit", "path"), name="mirror_file_once"
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="Rollout",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        (
                            "kind",
                            models.CharField(
                                choices=[("update", "update"), ("rollback", "rollback")],
                                max_length=10,
                            ),
                        ),
                        (
                            "state",
                            models.CharField(
                                choices=[
                                    ("fetching", "fetching"),
                                    ("rolling", "rolling"),
                                    ("done", "done"),
                                    ("failed", "failed"),
                                    ("halted", "halted"),
                                ],
                                db_index=True,
                                default="fetching",
                                max_length=10,
                            ),
                        ),
                        ("from_commit", models.CharField(blank=True, default="", max_length=64)),
                        ("to_commit", models.CharField(blank=True, default="", max_length=64)),
                        ("from_source", models.CharField(blank=True, default="", max_length=2000)),
                        ("to_source", models.CharField(blank=True, default="", max_length=2000)),
                        ("step", models.CharField(blank=True, default="", max_length=300)),
                        ("message", models.TextField(blank=True, default="")),
                        ("replaced", models.PositiveIntegerField(default=0)),
                        ("total", models.PositiveIntegerField(default=0)),
                        ("actor_name", models.CharField(default="", max_length=150)),
                        ("door", models.CharField(default="api", max_length=20)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("finished_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "fetch",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to="registry.fetch",
                            ),
                        ),
                        (
                            "model",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="rollouts",
                                to="catalog.model",
                            ),
                        ),
                        (
                            "requested_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "catalog_rollout",
                        "ordering": ["-created_at", "-id"],
                        "constraints": [
                            models.UniqueConstraint(
                                condition=models.Q(("state__in", ["fetching", "rolling"])),
                                fields=("model",),
                                name="one_active_rollout",
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(forwards, backwards),
    ]

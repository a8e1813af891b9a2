"""Moving Fetch, MirrorFile and Rollout from the catalog app to this one keeps every row.

The test takes the database back to before the move (catalog 0006), fills it as an installation
of that time would be (rows of every moved model, a rollout with its audit trail, admin history
and a permission granted on it), runs `migrate` as an upgrade does, and checks that the same rows
are there under the new app: same ids, same content types, history still attached. It is smoke,
so CI runs it on PostgreSQL (the whole suite) and on SQLite (the smoke part).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from catalog.models import AuditEntry, Model
from registry.models import Fetch, MirrorFile, Rollout

pytestmark = [pytest.mark.smoke, pytest.mark.django_db(transaction=True)]

BEFORE_THE_MOVE = ("catalog", "0006_model_canary")
MOVED = ("fetch", "mirrorfile", "rollout")


def _fill_as_before_the_move(user: Any) -> dict[str, Any]:
    """Rows written through the models as they were at catalog 0006."""
    old = MigrationExecutor(connection).loader.project_state(BEFORE_THE_MOVE).apps
    OldModel = old.get_model("catalog", "Model")
    OldFetch = old.get_model("catalog", "Fetch")
    OldMirrorFile = old.get_model("catalog", "MirrorFile")
    OldRollout = old.get_model("catalog", "Rollout")
    OldAuditEntry = old.get_model("catalog", "AuditEntry")

    profiles = [{"name": "cpu", "memory_gb": 1, "cores": 1}]
    chat = OldModel.objects.create(name="chat", source="http://h/a.gguf", profiles=profiles)
    embed = OldModel.objects.create(name="embed", source="http://h/b.gguf", profiles=profiles)
    fetches = [
        OldFetch.objects.create(
            repo="acme/chat", commit=f"{n}" * 40, files=[], state="done", requested_by_id=user.pk
        )
        for n in range(3)
    ]
    for n in range(4):
        OldMirrorFile.objects.create(
            repo="acme/chat",
            commit=f"{n}" * 40,
            path="chat.gguf",
            sha256="f" * 64,
            size=10 + n,
            source_url=f"http://hub/acme/chat/{n}",
        )
    done = OldRollout.objects.create(
        model_id=chat.pk,
        kind="update",
        state="done",
        from_commit="0" * 40,
        to_commit="1" * 40,
        fetch_id=fetches[1].pk,
        replaced=2,
        total=2,
        requested_by_id=user.pk,
        actor_name=user.username,
        door="cli",
    )
    OldRollout.objects.create(
        model_id=chat.pk, kind="rollback", state="done", actor_name=user.username
    )
    OldRollout.objects.create(
        model_id=embed.pk, kind="update", state="fetching", fetch_id=fetches[2].pk
    )
    for action in ("update", "update-swap", "update-done"):
        OldAuditEntry.objects.create(
            actor_name=user.username, model_name="chat", action=action, door="cli"
        )

    ContentType.objects.clear_cache()
    rollout_type, _ = ContentType.objects.get_or_create(app_label="catalog", model="rollout")
    entry = LogEntry.objects.create(
        user=user,
        content_type_id=rollout_type.pk,
        object_id=str(done.pk),
        object_repr=f"update of {chat.pk} (done)",
        action_flag=CHANGE,
        change_message="looked at the rollout of chat",
    )
    permission = Permission.objects.get(content_type=rollout_type, codename="view_rollout")
    Group.objects.create(name="auditors").permissions.add(permission)
    return {
        "rollout": done.pk,
        "log_entry": entry.pk,
        "content_types": {
            name: ContentType.objects.get(app_label="catalog", model=name).pk for name in MOVED
        },
        "permission": permission.pk,
    }


def test_it_keeps_every_row_and_the_history_when_the_models_move(
    django_user_model: Any,
) -> None:
    call_command("migrate", "registry", "zero", verbosity=0)  # back to catalog 0006
    with connection.cursor() as cursor:
        tables = connection.introspection.table_names(cursor)
    assert {"catalog_fetch", "catalog_mirrorfile", "catalog_rollout"} <= set(tables)
    admin = django_user_model.objects.create_superuser("root", password="pw")
    before = _fill_as_before_the_move(admin)

    call_command("migrate", verbosity=0)  # the upgrade
    ContentType.objects.clear_cache()

    assert Model.objects.count() == 2
    assert Fetch.objects.count() == 3
    assert MirrorFile.objects.count() == 4
    assert Rollout.objects.count() == 3
    rollout = Rollout.objects.select_related("model", "fetch").get(pk=before["rollout"])
    assert (rollout.model.name, rollout.kind, rollout.state) == ("chat", "update", "done")
    assert (rollout.replaced, rollout.total, rollout.requested_by_id) == (2, 2, admin.pk)
    assert rollout.fetch is not None and rollout.fetch.commit == "1" * 40
    assert list(Rollout.objects.filter(state__in=Rollout.ACTIVE).values_list("model__name"))
    assert [e.action for e in AuditEntry.objects.filter(model_name="chat").order_by("id")] == [
        "update",
        "update-swap",
        "update-done",
    ]

    # The content types were renamed, not created anew, and none is left for the catalog.
    for name, pk in before["content_types"].items():
        assert ContentType.objects.get(app_label="registry", model=name).pk == pk
    assert not ContentType.objects.filter(app_label="catalog", model__in=MOVED).exists()
    rollout_type = ContentType.objects.get_for_model(Rollout)
    assert rollout_type.pk == before["content_types"]["rollout"]

    # The rollout's admin history is still its history, and the grant still grants.
    [entry] = LogEntry.objects.filter(content_type=rollout_type, object_id=str(rollout.pk))
    assert entry.pk == before["log_entry"]
    permission = Permission.objects.get(content_type=rollout_type, codename="view_rollout")
    assert permission.pk == before["permission"]
    assert Group.objects.get(name="auditors").permissions.filter(pk=permission.pk).exists()
    client = Client()
    client.force_login(admin)
    page = client.get(f"/admin/registry/rollout/{rollout.pk}/history/")
    assert page.status_code == 200
    assert "looked at the rollout of chat" in page.content.decode()

    # New rows continue the old tables' ids.
    fresh = Rollout.objects.create(model=rollout.model, kind="rollback", state="done")
    assert fresh.pk > max(r.pk for r in Rollout.objects.exclude(pk=fresh.pk))


def test_it_leaves_no_catalog_content_types_on_a_fresh_database() -> None:
    call_command("migrate", verbosity=0)
    assert not ContentType.objects.filter(app_label="catalog", model__in=MOVED).exists()
    assert ContentType.objects.filter(app_label="registry", model__in=MOVED).count() == 3

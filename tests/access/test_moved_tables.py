"""A database made while keys, teams and usage were the gateway app's migrates to the access app
without losing a row: same tables, the gateway's migrations counted as the access app's, and the
content types (permissions, admin history) relabelled."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder

from access.models import GatewayKey, KeyUsageDay, Team
from access.services import key_create
from core.actor import Actor

pytestmark = [pytest.mark.smoke, pytest.mark.django_db(transaction=True)]

MOVED = ["team", "gatewaykey", "keypolicy", "userweight", "deletedgatewaykey", "routingversion",
         "trafficminute", "keyusageday"]  # fmt: skip


def _as_the_gateway_app_left_it() -> list[str]:
    """Put the bookkeeping back as the gateway app kept it: its migrations, its content types."""
    recorded = MigrationRecorder.Migration.objects
    names = sorted(
        name
        for name in recorded.filter(app="access").values_list("name", flat=True)
        if name < "0011"
    )
    recorded.filter(app="access").delete()
    recorded.bulk_create([recorded.model(app="gateway", name=name) for name in names])
    ContentType.objects.filter(app_label="access").update(app_label="gateway")
    ContentType.objects.clear_cache()
    return names


def test_the_gateway_apps_database_keeps_every_row(db: None) -> None:
    owner = get_user_model().objects.create_user("alice", password="alice-password-1")
    team = Team.objects.create(name="research", rpm=10)
    key, _ = key_create(actor=Actor.for_user(owner, "api"), name="ci")
    KeyUsageDay.objects.create(key=key, model="chat", day="2026-12-01", writer="w", requests=3)
    permission = Permission.objects.get(codename="change_gatewaykey")
    names = _as_the_gateway_app_left_it()
    assert names[0] == "0001_initial" and len(names) == 10

    call_command("migrate", verbosity=0, interactive=False)

    applied = set(
        MigrationRecorder.Migration.objects.filter(app="access").values_list("name", flat=True)
    )
    assert set(names) | {"0011_content_types_from_gateway"} <= applied
    assert GatewayKey.objects.get(pk=key.pk).key_hash == key.key_hash
    assert Team.objects.get(pk=team.pk).rpm == 10
    assert KeyUsageDay.objects.get(key=key).requests == 3
    ContentType.objects.clear_cache()
    labels = set(ContentType.objects.filter(model__in=MOVED).values_list("app_label", flat=True))
    assert labels == {"access"}
    assert Permission.objects.get(pk=permission.pk).content_type.app_label == "access"


def test_migrating_twice_changes_nothing(db: None) -> None:
    before = list(connection.introspection.table_names())
    call_command("migrate", verbosity=0, interactive=False)
    assert list(connection.introspection.table_names()) == before
    assert "gateway_gatewaykey" in before and not any(t.startswith("access_") for t in before)

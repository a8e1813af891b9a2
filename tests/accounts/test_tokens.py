"""API tokens are kept only as hashes, shown once, and the old plain-text ones keep working."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from rest_framework.test import APIClient

from accounts.models import ApiToken
from accounts.services import token_create

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]


def client_with(header: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    return client


def test_it_keeps_only_the_hash(users: dict[str, Any]) -> None:
    token, secret = token_create(user=users["alice"], name="laptop")
    row = ApiToken.objects.filter(pk=token.pk).values().get()
    assert secret not in str(row)
    assert row["digest"] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret.startswith(row["prefix"]) and len(row["prefix"]) < len(secret) // 3


def test_a_token_logs_in_by_either_scheme_and_its_use_is_recorded(users: dict[str, Any]) -> None:
    token, secret = token_create(user=users["alice"])
    assert client_with(f"Token {secret}").get("/api/v1/models").status_code == 200
    assert client_with(f"Bearer {secret}").get("/api/v1/models").status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None
    assert client_with(f"Token {secret}x").get("/api/v1/models").status_code == 401
    users["alice"].is_active = False
    users["alice"].save()
    assert client_with(f"Token {secret}").get("/api/v1/models").status_code == 401


def test_the_admin_shows_a_new_token_once_and_never_again(users: dict[str, Any]) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    client = Client()
    client.force_login(root)
    response = client.post(
        "/admin/accounts/apitoken/add/",
        {"user": users["bob"].pk, "name": "ci"},
        follow=True,
    )
    assert response.status_code == 200
    shown = re.search(r"The new token for bob is (llmgw_\w+)", response.content.decode())
    assert shown is not None
    secret = shown.group(1)
    assert client_with(f"Token {secret}").get("/api/v1/models").status_code == 200
    token = ApiToken.objects.get(user=users["bob"])
    listing = client.get("/admin/accounts/apitoken/").content.decode()
    page = client.get(f"/admin/accounts/apitoken/{token.pk}/change/").content.decode()
    for html in (listing, page):
        assert token.prefix in html
        assert secret not in html and token.digest not in html


def test_the_admin_command_prints_the_password_and_a_token_the_first_time_only(
    capsys: pytest.CaptureFixture[str], settings: Any, tmp_path: Any
) -> None:
    settings.VAR_DIR = tmp_path
    call_command("llmgw_admin")
    first = capsys.readouterr().out
    password = re.search(r"password (\S+)\)", first).group(1)  # type: ignore[union-attr]
    secret = re.search(r"LLMGW_TOKEN=(\w+)", first).group(1)  # type: ignore[union-attr]
    assert client_with(f"Token {secret}").get("/api/v1/models").status_code == 200
    from django.contrib.auth import authenticate
    from django.test import RequestFactory

    assert authenticate(RequestFactory().post("/login/"), username="admin", password=password)
    call_command("llmgw_admin")
    again = capsys.readouterr().out
    assert password not in again and "LLMGW_TOKEN=" not in again
    assert "manage.py llmgw_token admin" in again
    for printed in (first, again):  # where an OpenAI client's key comes from, both times
        assert "api_key from `.venv/bin/llmgw ctl key create NAME`" in printed
    assert ApiToken.objects.count() == 1
    assert not list(tmp_path.iterdir())  # nothing written in plain text


def test_the_token_command_issues_a_new_one(users: dict[str, Any]) -> None:
    from io import StringIO

    out = StringIO()
    call_command("llmgw_token", "carol", "--name", "script", stdout=out)
    secret = out.getvalue().strip()
    assert client_with(f"Bearer {secret}").get("/api/v1/models").status_code == 200
    assert ApiToken.objects.get().name == "script"


@pytest.mark.django_db(transaction=True)
def test_plain_text_tokens_from_before_are_hashed_and_removed(users: dict[str, Any]) -> None:
    from importlib import import_module

    from django.apps import apps

    migration = import_module("accounts.migrations.0002_hash_plaintext_tokens")
    old_key = "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, "
            "created timestamp NULL, user_id integer NOT NULL)"
        )
        cursor.execute(
            "INSERT INTO authtoken_token (key, user_id) VALUES (%s, %s)",
            [old_key, users["alice"].pk],
        )
    with connection.schema_editor() as editor:
        migration.hash_plaintext_tokens(apps, editor)
    assert "authtoken_token" not in connection.introspection.table_names()
    token = ApiToken.objects.get()
    assert token.user == users["alice"] and old_key not in str(ApiToken.objects.values().get())
    assert client_with(f"Token {old_key}").get("/api/v1/models").status_code == 200


def test_an_expired_token_is_refused(users: dict[str, Any]) -> None:
    from datetime import timedelta

    from django.utils import timezone

    _, soon = token_create(user=users["alice"], expires_at=timezone.now() + timedelta(hours=1))
    assert client_with(f"Token {soon}").get("/api/v1/models").status_code == 200
    _, past = token_create(user=users["alice"], expires_at=timezone.now() - timedelta(seconds=1))
    answer = client_with(f"Token {past}").get("/api/v1/models")
    assert answer.status_code == 401


def test_people_list_and_revoke_their_own_tokens_and_no_one_elses(users: dict[str, Any]) -> None:
    _, laptop_secret = token_create(user=users["alice"], name="laptop")
    script, script_secret = token_create(user=users["alice"], name="script")
    bobs, bobs_secret = token_create(user=users["bob"], name="bob's")
    alice = client_with(f"Token {laptop_secret}")
    listed = alice.get("/api/v1/tokens").json()
    assert {t["name"] for t in listed} == {"laptop", "script"}
    assert [t["current"] for t in listed if t["name"] == "laptop"] == [True]
    assert all(set(t) >= {"prefix", "expires_at", "last_used_at"} for t in listed)
    assert all(laptop_secret not in str(t) for t in listed)
    # Another's token is no different from none, and refusing it changes nothing.
    refused = alice.delete(f"/api/v1/tokens/{bobs.pk}")
    assert refused.status_code == 404 and "no API token" in refused.json()["detail"]
    assert alice.delete("/api/v1/tokens/x1").status_code == 404
    assert ApiToken.objects.filter(pk=bobs.pk).exists()
    assert alice.delete(f"/api/v1/tokens/{script.pk}").json()["name"] == "script"
    assert client_with(f"Token {script_secret}").get("/api/v1/models").status_code == 401
    # `current`: the token the request is made with (llmgw ctl logout).
    assert alice.delete("/api/v1/tokens/current").json()["name"] == "laptop"
    assert alice.get("/api/v1/tokens").status_code == 401
    assert client_with(f"Token {bobs_secret}").get("/api/v1/tokens").status_code == 200

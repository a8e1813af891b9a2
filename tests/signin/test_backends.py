"""Local passwords switched off: the console's and the admin's logins refuse everyone but the
break-glass administrators, and the login pages offer the provider instead."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from catalog.models import AuditEntry

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def passwords_off(settings: Any, users: dict[str, Any]) -> dict[str, Any]:
    settings.LLMGW_LOCAL_PASSWORDS = False
    settings.LLMGW_BREAK_GLASS_USERS = ["admin"]
    users["admin"] = get_user_model().objects.create_superuser("admin", password="admin-pw-1")
    return users


def log_in(path: str, username: str, password: str) -> Any:
    return Client().post(path, {"username": username, "password": password})


@pytest.mark.parametrize("path", ["/login/", "/admin/login/"])
def test_a_password_is_refused_but_to_a_break_glass_administrator(
    passwords_off: dict[str, Any], path: str
) -> None:
    refused = log_in(path, "staff", "staff-password-1")
    assert refused.status_code == 200
    assert "_auth_user_id" not in refused.wsgi_request.session
    assert log_in(path, "alice", "alice-password-1").status_code == 200
    allowed = log_in(path, "admin", "admin-pw-1")
    assert allowed.status_code == 302
    door = "admin" if path.startswith("/admin/") else "console"
    refusals = AuditEntry.objects.filter(action="sign-in-refused").order_by("id")
    assert [(e.model_name, e.door, e.after["code"]) for e in refusals] == [
        ("user staff", door, "local_passwords_off"),
        ("user alice", door, "local_passwords_off"),
    ]


def test_passwords_stay_on_by_default(users: dict[str, Any]) -> None:
    assert log_in("/login/", "alice", "alice-password-1").status_code == 302
    assert log_in("/admin/login/", "staff", "staff-password-1").status_code == 302


def test_the_login_page_offers_the_provider_and_hides_the_form(
    passwords_off: dict[str, Any], settings: Any
) -> None:
    settings.LLMGW_OIDC_ISSUER = "https://login.example.com"
    settings.LLMGW_OIDC_PROVIDER_NAME = "Example Corp"
    page = Client().get("/login/?next=/keys/").content.decode()
    assert (
        '<a class="button" id="signin-provider" href="/signin/start?next=/keys/">'
        "Sign in with Example Corp</a>"
    ) in page
    assert '<details id="break-glass">' in page
    assert "<summary>Break-glass administrator</summary>" in page
    refused = log_in("/login/", "alice", "alice-password-1").content.decode()
    assert "Local passwords are switched off here: sign in with Example Corp instead." in refused
    admin_page = Client().get("/admin/login/?next=/admin/").content.decode()
    assert 'href="/signin/start?next=/admin/"' in admin_page
    assert "this form is for the break-glass administrators only" in admin_page


def test_without_a_provider_the_login_page_is_as_before(users: dict[str, Any]) -> None:
    page = Client().get("/login/").content.decode()
    assert "signin-provider" not in page
    assert "break-glass" not in page
    assert '<input id="password" type="password"' in page
    assert "Sign in with" not in Client().get("/admin/login/").content.decode()


def test_password_logins_and_logouts_are_audited_while_a_provider_is_set(
    passwords_off: dict[str, Any], settings: Any
) -> None:
    settings.LLMGW_OIDC_ISSUER = "https://login.example.com"
    client = Client()
    assert (
        client.post("/admin/login/", {"username": "admin", "password": "admin-pw-1"}).status_code
        == 302
    )
    client.post("/logout/")
    entries = AuditEntry.objects.filter(model_name="user admin").order_by("id")
    assert [(e.action, e.door, e.note) for e in entries] == [
        ("sign-in", "admin", "logged in with a local password"),
        ("sign-out", "console", "logged out"),
    ]

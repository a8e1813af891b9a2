"""The Keys page: a user's own keys (staff: everyone's), made with the key shown once, limited and
revoked through the same services as the API, with use against each limit."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from access.models import GatewayKey, KeyUsageDay
from access.services import key_create, team_add
from catalog.models import AuditEntry
from core.actor import Actor
from tests.console.pages import KEY_LIMITS_UNCHANGED, text_of

pytestmark = [pytest.mark.django_db]

HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/keys/"}


def make_key(users: dict[str, Any], owner: str = "alice", **limits: Any) -> GatewayKey:
    return key_create(
        actor=Actor.for_user(users[owner], "api"), name=f"{owner}'s app", limits=limits
    )[0]


def test_the_page_lists_my_keys_with_use_against_each_limit(
    client_for: Any, users: dict[str, Any]
) -> None:
    mine = make_key(users, tokens_per_day=1000, rpm=60)
    make_key(users, "bob")
    KeyUsageDay.objects.create(
        key=mine,
        model="m",
        day=datetime.now(UTC).date(),
        requests=3,
        prompt_tokens=200,
        completion_tokens=50,
    )
    response = client_for("alice").get("/keys/")
    assert response.status_code == 200
    text = text_of(response)
    assert "alice's app" in text and "bob's app" not in text
    assert "Tokens today 250 of 1,000 (25%)" in text
    assert "Tokens this month 250, no limit" in text
    assert "3 requests today · Requests per minute: 60 · Tokens per minute: no limit" in text
    assert 'aria-current="page">Keys</a>' in response.content.decode()
    staff = text_of(client_for("staff").get("/keys/"))
    assert "alice's app" in staff and "bob's app" in staff


def test_a_new_key_is_shown_once_and_kept_only_as_its_hash(
    client_for: Any, users: dict[str, Any]
) -> None:
    client = client_for("alice")
    response = client.post(
        "/keys/create",
        {"name": "billing", "team": "", "rpm": "30", "models": "llama-*", "expires": "30d"},
        headers=HTMX,
    )
    assert response.status_code == 201, text_of(response)
    key = GatewayKey.objects.get()
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="keys-body">')
    secret = html.split('id="new-key-secret">')[1].split("<")[0]
    assert secret.startswith(key.prefix) and key.key_hash != secret
    assert (key.rpm, key.models) == (30, ["llama-*"]) and key.expires_at is not None
    assert secret not in client.get("/keys/").content.decode()  # shown only this once
    assert AuditEntry.objects.get(action="key-create").door == "console"


def test_a_refused_key_shows_why_and_makes_nothing(client_for: Any, users: dict[str, Any]) -> None:
    team_add(
        actor=Actor.for_user(users["staff"], "api"),
        name="research",
        limits={"tpm": 100},
        members=["alice"],
    )
    response = client_for("alice").post(
        "/keys/create", {"name": "bot", "team": "research", "tpm": "500"}, headers=HTMX
    )
    assert response.status_code == 400
    assert (
        "tpm: 500 is above the team research's 100; a key's limit is at most its team's"
        in text_of(response)
    )
    assert not GatewayKey.objects.exists()
    nameless = client_for("alice").post("/keys/create", {"name": ""}, headers=HTMX)
    assert nameless.status_code == 400
    assert "Give the key a name that says what it is for." in text_of(nameless)


def test_the_owner_sets_limits_and_only_what_changed_is_sent(
    client_for: Any, users: dict[str, Any]
) -> None:
    key = make_key(users, rpm=60, tpm=1000)
    form = {**KEY_LIMITS_UNCHANGED, "rpm": "60", "tpm": "1000"}
    response = client_for("alice").post(
        f"/keys/{key.pk}/limits", {**form, "rpm": "none", "max_parallel": "4"}, headers=HTMX
    )
    assert response.status_code == 200, text_of(response)
    assert (
        response.content.decode()
        .lstrip()
        .startswith(f'<article class="card key" id="key-{key.pk}"')
    )
    assert "Limits in force now; the gateway holds them within a second." in text_of(response)
    key.refresh_from_db()
    assert (key.rpm, key.tpm, key.max_parallel) == (None, 1000, 4)
    entry = AuditEntry.objects.get(action="key-limits")
    assert set(entry.changes) == {"rpm", "max_parallel"} and entry.door == "console"

    raised = client_for("alice").post(
        f"/keys/{key.pk}/limits", {**form, "weight": "5"}, headers=HTMX
    )
    assert raised.status_code == 400
    assert "5 is above the default 1; only staff give a key a larger share" in text_of(raised)


def test_someone_elses_key_is_missing_and_staff_may_change_it(
    client_for: Any, users: dict[str, Any]
) -> None:
    key = make_key(users)
    for path in (f"/keys/{key.pk}/limits", f"/keys/{key.pk}/revoke"):
        response = client_for("carol").post(path, {"rpm": "1"}, headers=HTMX)
        assert response.status_code == 404
        assert f"There is no gateway key {key.pk} of yours; the Keys page lists them." in text_of(
            response
        )
    key.refresh_from_db()
    assert key.rpm is None and key.revoked_at is None
    response = client_for("staff").post(f"/keys/{key.pk}/revoke")
    assert response.status_code == 302
    key.refresh_from_db()
    assert key.revoked_by == users["staff"]


def test_revoking_answers_the_card_without_its_forms(
    client_for: Any, users: dict[str, Any]
) -> None:
    key = make_key(users)
    response = client_for("alice").post(f"/keys/{key.pk}/revoke", headers=HTMX)
    assert response.status_code == 200
    text = text_of(response)
    assert f"{key.prefix}… (alice's app) is revoked: requests with it get 401." in text
    assert "Set limits" not in text and "revoked" in text


def test_the_page_needs_a_login(client: Any) -> None:
    response = client.get("/keys/")
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_the_audit_links_a_keys_entries_to_the_keys_page(
    client_for: Any, users: dict[str, Any]
) -> None:
    key = make_key(users)
    team_add(actor=Actor.for_user(users["staff"], "api"), name="research")
    html = client_for("staff").get("/audit/").content.decode()
    assert f'<a href="/keys/#key-{key.pk}">key #{key.pk}</a>' in html
    assert "<td>team research</td>" in html  # a team has no page to link to


def test_keys_come_a_page_at_a_time(client_for: Any, users: dict[str, Any], settings: Any) -> None:
    from console.views import keys

    settings.LLMGW_MAX_KEYS_PER_USER = 100
    made = [make_key(users) for _ in range(keys.KEYS_PER_PAGE + 2)]
    first = client_for("alice").get("/keys/")
    assert text_of(first).count("Set limits") == keys.KEYS_PER_PAGE * 2  # summary and button
    assert f"Page 1 of 2 · {len(made)} in all" in text_of(first)
    second = client_for("alice").get("/keys/?page=2")
    assert f'id="key-{made[0].pk}"' in second.content.decode()


def test_a_refused_change_without_htmx_answers_the_page_with_the_form(
    client_for: Any, users: dict[str, Any]
) -> None:
    key = make_key(users)
    response = client_for("alice").post(f"/keys/{key.pk}/limits", {"weight": "9"})
    assert response.status_code == 400
    text = text_of(response)
    assert "9 is above the default 1; only staff give a key a larger share" in text
    assert text.count("alice's app") == 1

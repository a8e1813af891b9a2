"""Gateway keys: the REST API's owner rules, 401s in OpenAI's shape, revocation, the admin action."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import OperationalError, connection

from catalog.errors import CatalogError
from catalog.services import Actor
from gateway.models import GatewayKey, hash_key
from gateway.services import key_create, key_revoke
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.smoke


def test_it_creates_a_key_shown_once_and_keeps_only_its_hash(api: Any) -> None:
    response = api("alice").post("/api/v1/keys", {"name": "billing bot"}, format="json")
    assert response.status_code == 201
    body = response.json()
    secret = body["key"]
    assert secret.startswith("llmgw-") and len(secret) > 40
    assert body["prefix"] == secret[:12] and body["owner"] == "alice" and body["state"] == "active"
    stored = GatewayKey.objects.get(pk=body["id"])
    assert stored.key_hash == hash_key(secret)
    assert secret not in {stored.prefix, stored.name, stored.key_hash}
    listed = api("alice").get("/api/v1/keys").json()
    assert [k["id"] for k in listed] == [body["id"]] and "key" not in listed[0]


def test_it_refuses_a_key_without_a_name(api: Any) -> None:
    response = api("alice").post("/api/v1/keys", {"name": ""}, format="json")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid"


def test_users_see_their_own_keys_and_staff_see_all(api: Any, users: dict[str, Any]) -> None:
    alice = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    bob = key_create(actor=Actor.for_user(users["bob"], "api"), name="b")[0]
    assert [k["id"] for k in api("alice").get("/api/v1/keys").json()] == [alice.pk]
    assert [k["id"] for k in api("bob").get("/api/v1/keys").json()] == [bob.pk]
    assert {k["id"] for k in api("staff").get("/api/v1/keys").json()} == {alice.pk, bob.pk}


def test_an_outsider_cannot_revoke_someone_elses_key(api: Any, users: dict[str, Any]) -> None:
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    response = api("carol").post(f"/api/v1/keys/{key.pk}/revoke")
    assert response.status_code == 404
    assert response.json() == {
        "detail": f"There is no gateway key {key.pk} of yours; `llmgw ctl keys` lists them.",
        "code": "not_found",
    }
    key.refresh_from_db()
    assert key.revoked_at is None


def test_the_owner_and_staff_can_revoke(api: Any, users: dict[str, Any]) -> None:
    mine = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    theirs = key_create(actor=Actor.for_user(users["bob"], "api"), name="b")[0]
    first = api("alice").post(f"/api/v1/keys/{mine.pk}/revoke")
    assert first.status_code == 200
    assert first.json()["state"] == "revoked" and first.json()["revoked_by"] == "alice"
    assert api("staff").post(f"/api/v1/keys/{theirs.pk}/revoke").json()["revoked_by"] == "staff"
    # Revoking again changes nothing, and is not an error.
    again = api("staff").post(f"/api/v1/keys/{mine.pk}/revoke")
    assert again.status_code == 200
    assert again.json()["revoked_by"] == "alice"
    assert again.json()["revoked_at"] == first.json()["revoked_at"]


def test_a_user_holds_at_most_the_configured_number_of_active_keys(api: Any, settings: Any) -> None:
    settings.LLMGW_MAX_KEYS_PER_USER = 2
    first, _ = (
        api("alice").post("/api/v1/keys", {"name": f"app {n}"}, format="json").json()["id"]
        for n in range(2)
    )
    response = api("alice").post("/api/v1/keys", {"name": "one too many"}, format="json")
    assert response.status_code == 409
    assert response.json() == {
        "detail": "You have 2 active gateway keys, and one user may hold at most 2. Revoke the "
        "keys you no longer use (`llmgw ctl keys` lists them, `llmgw ctl key revoke ID` revokes "
        "one), or ask the operator to raise LLMGW_MAX_KEYS_PER_USER.",
        "code": "too_many_keys",
    }
    assert GatewayKey.objects.filter(owner__username="alice").count() == 2
    # The limit is each user's own, staff's too.
    assert api("bob").post("/api/v1/keys", {"name": "b"}, format="json").status_code == 201
    for n in range(2):
        assert (
            api("staff").post("/api/v1/keys", {"name": f"s{n}"}, format="json").status_code == 201
        )
    assert api("staff").post("/api/v1/keys", {"name": "s2"}, format="json").status_code == 409
    # A revoked key no longer counts.
    assert api("alice").post(f"/api/v1/keys/{first}/revoke").status_code == 200
    assert api("alice").post("/api/v1/keys", {"name": "again"}, format="json").status_code == 201


@pytest.mark.django_db(transaction=True)
def test_two_creates_at_once_cannot_both_pass_the_limit(
    users: dict[str, Any], settings: Any
) -> None:
    settings.LLMGW_MAX_KEYS_PER_USER = 1
    start = threading.Barrier(2)
    outcomes: list[str] = []

    def create(n: int) -> None:
        start.wait()
        try:
            for _ in range(200):
                try:
                    key_create(actor=Actor.for_user(users["alice"], "api"), name=f"racer {n}")
                    outcomes.append("created")
                    return
                except CatalogError as exc:
                    outcomes.append(exc.code)
                    return
                except OperationalError as exc:
                    # SQLite's in-memory test database says "table is locked" at once where a
                    # database file waits its timeout for the other writer: wait here instead.
                    assert "locked" in str(exc)
                    time.sleep(0.01)
        finally:
            connection.close()

    racers = [threading.Thread(target=create, args=(n,)) for n in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=30)
    assert sorted(outcomes) == ["created", "too_many_keys"]
    assert GatewayKey.objects.filter(owner=users["alice"]).count() == 1


def test_the_keys_api_needs_a_user_not_a_gateway_key(client: Any, keys: dict[str, str]) -> None:
    response = client.get("/api/v1/keys", HTTP_AUTHORIZATION=f"Bearer {keys['alice']}")
    assert response.status_code == 401


# -- the gateway's door -------------------------------------------------------------------


def test_it_answers_401_in_openais_shape_without_a_key(gateway_server: Any, db: Any) -> None:
    response = Gateway(gateway_server.url, None).get("/v1/models")
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json() == {
        "error": {
            "message": "No API key was sent. Send a gateway key as 'Authorization: Bearer KEY' "
            "(OpenAI clients: api_key=KEY); create one with `llmgw ctl key create NAME`.",
            "type": "invalid_request_error",
            "param": None,
            "code": "missing_api_key",
        }
    }


def test_it_refuses_a_key_it_does_not_know(gateway_server: Any, db: Any) -> None:
    response = Gateway(gateway_server.url, "llmgw-not-a-real-key").post(
        "/v1/completions", {"model": "x"}
    )
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert error["message"].startswith("This API key is not one the gateway knows.")


def test_a_user_api_token_does_not_open_the_gateway(
    gateway_server: Any, tokens: dict[str, str]
) -> None:
    response = Gateway(gateway_server.url, tokens["alice"]).get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_revoked_key_gets_401_saying_so(gw: Any, users: dict[str, Any]) -> None:
    assert gw.get("/v1/models").status_code == 200
    key_revoke(
        actor=Actor.for_user(users["alice"], "api"),
        key_id=GatewayKey.objects.get(key_hash=hash_key(gw.key)).pk,
    )
    response = gw.get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"] == {
        "message": "This API key was revoked, so it opens nothing any more. Ask its owner for a "
        "new one, or create your own with `llmgw ctl key create NAME`.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


def test_last_use_is_written_at_most_once_a_minute(gw: Any) -> None:
    key = GatewayKey.objects.get(key_hash=hash_key(gw.key))
    assert key.last_used_at is None
    assert gw.get("/v1/models").status_code == 200  # and the gateway writes its use after
    key.refresh_from_db()
    first = key.last_used_at
    assert first is not None
    assert gw.get("/v1/models").status_code == 200
    key.refresh_from_db()
    assert key.last_used_at == first  # written again only a minute later


# -- the admin ----------------------------------------------------------------------------


def test_the_admin_lists_keys_read_only_and_revokes_them(
    client: Any, users: dict[str, Any]
) -> None:
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.create_superuser("root", password="root-password-1")
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    client.force_login(admin)
    page = client.get("/admin/gateway/gatewaykey/")
    assert page.status_code == 200 and key.prefix in page.content.decode()
    assert client.get("/admin/gateway/gatewaykey/add/").status_code == 403
    response = client.post(
        "/admin/gateway/gatewaykey/",
        {"action": "revoke", "_selected_action": [key.pk]},
        follow=True,
    )
    assert "1 key(s) revoked" in response.content.decode()
    key.refresh_from_db()
    assert key.revoked_at is not None and key.revoked_by == admin

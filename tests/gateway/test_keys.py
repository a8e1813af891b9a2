"""Gateway keys: the REST API's owner rules, 401s in OpenAI's shape, revocation, the admin action."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from access.models import GatewayKey, hash_key
from access.services import key_create, key_revoke, team_add
from catalog.models import AuditEntry
from core.actor import Actor
from core.refusals import Refused
from tests.gateway.conftest import Gateway
from tests.support.waiting import wait_for

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


@pytest.mark.parametrize("key_id", [2**62, 2**63 - 1, 10**30])
def test_an_id_past_what_a_database_holds_is_no_key(api: Any, key_id: int) -> None:
    """An id no database integer could hold is refused as no such key (404 naming it), not
    passed to the database to fail there."""
    from access.models import GatewayKey

    before = GatewayKey.objects.count()
    for method, path, body in (
        ("post", f"/api/v1/keys/{key_id}/revoke", None),
        ("patch", f"/api/v1/keys/{key_id}/limits", {"rpm": 5}),
    ):
        response = getattr(api("staff"), method)(path, body, format="json")
        assert response.status_code == 404, response.content
        assert response.json() == {
            "detail": f"There is no gateway key {key_id} of yours; `llmgw ctl keys` lists them.",
            "code": "not_found",
        }
    assert GatewayKey.objects.count() == before


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
        def outcome() -> str | None:
            try:
                key_create(actor=Actor.for_user(users["alice"], "api"), name=f"racer {n}")
            except Refused as exc:
                return exc.code
            except OperationalError as exc:
                # SQLite's in-memory test database says "table is locked" at once where a
                # database file waits its timeout for the other writer: look again instead.
                assert "locked" in str(exc)
                return None
            return "created"

        start.wait()
        try:
            outcomes.append(
                wait_for(outcome, timeout=10, what=f"racer {n} created or refused", not_yet=())
            )
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
            "(OpenAI clients: api_key=KEY) or 'x-api-key: KEY' (Anthropic clients: "
            "ANTHROPIC_API_KEY); create one with `llmgw ctl key create NAME`.",
            "type": "invalid_request_error",
            "param": None,
            "code": "missing_api_key",
            "request_id": response.headers["X-Request-ID"],
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
        "request_id": response.headers["X-Request-ID"],
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


def test_the_admin_lists_keys_adds_none_and_revokes_them(
    client: Any, users: dict[str, Any]
) -> None:
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.create_superuser("root", password="root-password-1")
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    client.force_login(admin)
    page = client.get("/admin/access/gatewaykey/")
    assert page.status_code == 200 and key.prefix in page.content.decode()
    assert client.get("/admin/access/gatewaykey/add/").status_code == 403
    response = client.post(
        "/admin/access/gatewaykey/",
        {"action": "revoke", "_selected_action": [key.pk]},
        follow=True,
    )
    assert "1 key(s) revoked" in response.content.decode()
    key.refresh_from_db()
    assert key.revoked_at is not None and key.revoked_by == admin


# -- limits, team and expiry ------------------------------------------------------------------


def test_a_key_is_created_with_its_limits_and_lists_them_with_its_usage(
    api: Any, users: dict[str, Any]
) -> None:
    from datetime import UTC, datetime

    from access.models import KeyUsageDay

    response = api("alice").post(
        "/api/v1/keys",
        {
            "name": "bot",
            "rpm": 60,
            "tokens_per_day": 100000,
            "models": ["llama-*"],
            "expires": "30d",
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["limits"] == {
        "rpm": 60,
        "tpm": None,
        "max_parallel": None,
        "tokens_per_day": 100000,
        "tokens_per_month": None,
        "models": ["llama-*"],
        "weight": 1.0,
    }
    assert body["team"] is None and body["expired"] is False
    assert body["expires_at"] > timezone.now().isoformat()
    today = datetime.now(UTC).date()
    KeyUsageDay.objects.create(
        key_id=body["id"],
        model="m",
        day=today,
        writer="a",
        requests=3,
        prompt_tokens=10,
        completion_tokens=5,
    )
    KeyUsageDay.objects.create(
        key_id=body["id"],
        model="m",
        day=today,
        writer="b",
        requests=1,
        prompt_tokens=1,
        completion_tokens=1,
    )
    listed = api("alice").get("/api/v1/keys").json()[0]
    assert listed["usage"]["requests_today"] == 4
    assert listed["usage"]["tokens_today"] == 17
    assert listed["usage"]["tokens_this_month"] >= 17


def test_the_owner_sets_and_lifts_limits_and_it_is_audited(api: Any, users: dict[str, Any]) -> None:
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a", limits={"rpm": 10})[0]
    response = api("alice").patch(
        f"/api/v1/keys/{key.pk}/limits", {"rpm": 0, "tpm": 5000, "weight": 0.5}, format="json"
    )
    assert response.status_code == 200, response.json()
    limits = response.json()["limits"]
    assert limits["rpm"] is None and limits["tpm"] == 5000 and limits["weight"] == 0.5
    entry = AuditEntry.objects.get(action="key-limits")
    assert entry.model_name == f"key #{key.pk}" and entry.actor_name == "alice"
    assert entry.changes["rpm"] == [10, None] and entry.changes["tpm"] == [None, 5000]


def test_someone_elses_key_limits_are_not_found(api: Any, users: dict[str, Any]) -> None:
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    response = api("carol").patch(f"/api/v1/keys/{key.pk}/limits", {"rpm": 1}, format="json")
    assert response.status_code == 404
    assert (
        api("staff")
        .patch(f"/api/v1/keys/{key.pk}/limits", {"rpm": 1}, format="json")
        .json()["limits"]["rpm"]
        == 1
    )


def test_a_keys_limit_above_its_teams_is_refused_saying_the_teams_figure(
    api: Any, users: dict[str, Any]
) -> None:
    staff = Actor.for_user(users["staff"], "api")
    team_add(actor=staff, name="research", limits={"rpm": 100}, members=["alice"])
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a", team="research")[0]
    response = api("alice").patch(f"/api/v1/keys/{key.pk}/limits", {"rpm": 500}, format="json")
    assert response.status_code == 400
    assert response.json()["detail"] == (
        "The change was refused, nothing was changed: rpm: 500 is above the team "
        "research's 100; a key's limit is at most its team's (ask staff to raise the team's)."
    )
    key.refresh_from_db()
    assert key.rpm is None
    assert (
        api("alice").patch(f"/api/v1/keys/{key.pk}/limits", {"rpm": 50}, format="json").status_code
        == 200
    )


def test_an_owner_cannot_raise_a_keys_weight_and_staff_can(api: Any, users: dict[str, Any]) -> None:
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    refused = api("alice").patch(f"/api/v1/keys/{key.pk}/limits", {"weight": 4}, format="json")
    assert refused.status_code == 400
    assert (
        "weight: 4 is above the default 1; only staff give a key a larger share"
        in (refused.json()["detail"])
    )
    done = api("staff").patch(f"/api/v1/keys/{key.pk}/limits", {"weight": 4}, format="json")
    assert done.json()["limits"]["weight"] == 4.0


def test_a_key_goes_only_into_a_team_its_owner_is_in(api: Any, users: dict[str, Any]) -> None:
    team_add(actor=Actor.for_user(users["staff"], "api"), name="research", members=["bob"])
    response = api("alice").post("/api/v1/keys", {"name": "a", "team": "research"}, format="json")
    assert response.status_code == 404
    assert response.json()["detail"] == (
        "There is no team 'research' that alice is a member of; `llmgw ctl teams` lists yours, "
        "and staff add members."
    )
    assert not GatewayKey.objects.exists()  # nothing half-made


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"rpm": -1}, "rpm"),
        ({"rpm": 2**63}, "rpm"),
        ({"weight": 0}, "weight"),
        ({"weight": 1001}, "weight"),
        ({"models": ["llama 3"]}, "models"),
        ({"models": [""]}, "models"),
        ({"expires": "yesterday"}, "expires"),
        ({"expires": "2020-01-01"}, "expires"),
        ({"team": "x" * 300}, "team"),
        ({"colour": "red"}, ""),
    ],
)
def test_bad_limits_are_refused_and_change_nothing(
    api: Any, users: dict[str, Any], changes: dict[str, Any], problem: str
) -> None:
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a", limits={"rpm": 7})[0]
    response = api("alice").patch(
        f"/api/v1/keys/{key.pk}/limits", {**changes, "tpm": 9}, format="json"
    )
    assert 400 <= response.status_code < 500, response.content
    assert response.json()["code"] in ("invalid", "not_found")
    if problem:
        assert problem in json.dumps(response.json())
    key.refresh_from_db()
    assert (key.rpm, key.tpm) == (7, None)


def test_an_expiry_is_a_duration_or_a_date_and_none_lifts_it(users: dict[str, Any]) -> None:
    from datetime import timedelta

    from access.services import key_set_limits, parse_expiry

    now = timezone.now()
    assert parse_expiry("12h", now=now) == now + timedelta(hours=12)
    assert parse_expiry("2999-01-31", now=now).isoformat() == "2999-01-31T00:00:00+00:00"
    assert parse_expiry("none", now=now) is None
    assert parse_expiry("2999-01-01T02:00:00+02:00", now=now).isoformat() == (
        "2999-01-01T00:00:00+00:00"
    )
    with pytest.raises(ValueError, match="already past"):
        parse_expiry("2001-01-01T10:00:00Z", now=now)
    alice = Actor.for_user(users["alice"], "cli")
    key = key_create(actor=alice, name="a", expires="1d")[0]
    assert key.expires_at is not None
    assert (
        key_set_limits(actor=alice, key_id=key.pk, changes={"expires": "none"}).expires_at is None
    )


def test_limits_read_the_same_from_every_door(users: dict[str, Any]) -> None:
    from access.services import key_set_limits

    alice = Actor.for_user(users["alice"], "cli")
    key = key_create(actor=alice, name="a")[0]
    # As the CLI and the console's forms send them: text, 0 and none lift.
    key = key_set_limits(
        actor=alice,
        key_id=key.pk,
        changes={"rpm": "30", "tpm": "none", "max_parallel": "0", "models": "a, b*"},
    )
    assert (key.rpm, key.tpm, key.max_parallel, key.models) == (30, None, None, ["a", "b*"])
    with pytest.raises(Refused) as refused:
        key_set_limits(actor=alice, key_id=key.pk, changes={"rpm": "lots"})
    assert str(refused.value) == (
        "The change was refused, nothing was changed: rpm: is a whole number from 1 up, or 0 or "
        "none for no limit, not 'lots'."
    )
    # Text int() would take, or fail on with an error of its own, is refused the same way.
    for text in ("²", "9" * 5000, "1e3", "-5"):
        with pytest.raises(Refused, match="rpm: is a whole number from 1 up"):
            key_set_limits(actor=alice, key_id=key.pk, changes={"rpm": text})


def _key_form(key: GatewayKey, **fields: Any) -> dict[str, Any]:
    """The admin's key form as it comes, with `fields` changed."""
    form: dict[str, Any] = {
        "team": key.team_id or "",
        "expires_at_0": "",
        "expires_at_1": "",
        "rpm": key.rpm or "",
        "tpm": key.tpm or "",
        "max_parallel": key.max_parallel or "",
        "tokens_per_day": key.tokens_per_day or "",
        "tokens_per_month": key.tokens_per_month or "",
        "models": ", ".join(key.models),
        "weight": key.weight,
    }
    return {**form, **fields}


def test_the_admin_changes_a_keys_limits_through_the_service(
    client: Any, users: dict[str, Any]
) -> None:
    from django.contrib.auth import get_user_model

    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    team = team_add(actor=Actor.for_user(root, "admin"), name="research", limits={"tpm": 1000})
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="a")[0]
    client.force_login(root)
    url = f"/admin/access/gatewaykey/{key.pk}/change/"
    assert client.get(url).status_code == 200

    refused = client.post(url, _key_form(key, team=team.pk, tpm=5000))
    assert refused.status_code == 200
    assert "tpm: 5,000 is above the team research&#x27;s 1,000" in refused.content.decode()
    key.refresh_from_db()
    assert (key.team_id, key.tpm) == (None, None)

    done = client.post(url, _key_form(key, team=team.pk, tpm=500, models="llama-*, qwen"))
    assert done.status_code == 302
    key.refresh_from_db()
    assert (key.team_id, key.tpm, key.models) == (team.pk, 500, ["llama-*", "qwen"])
    entry = AuditEntry.objects.get(action="key-limits")
    assert (entry.actor_name, entry.door) == ("root", "admin")
    # What staff set on a key is its ceiling: the audit has that too.
    assert set(entry.changes) == {"team", "tpm", "models", "ceilings"}
    assert entry.changes["ceilings"] == [{}, {"tpm": 500, "models": ["llama-*", "qwen"]}]


def test_usage_is_read_for_any_number_of_keys(
    api: Any, users: dict[str, Any], settings: Any, monkeypatch: Any
) -> None:
    from datetime import UTC, datetime

    from access import selectors
    from access.models import KeyUsageDay

    # A few ids a query, as a great many are asked in chunks (SQLite bounds a query's parameters).
    monkeypatch.setattr(selectors, "USAGE_CHUNK", 2)
    settings.LLMGW_MAX_KEYS_PER_USER = 10
    today = datetime.now(UTC).date()
    for n in range(5):
        key = key_create(actor=Actor.for_user(users["alice"], "api"), name=f"k{n}")[0]
        KeyUsageDay.objects.create(
            key=key, model="m", day=today, requests=n, prompt_tokens=n, completion_tokens=0
        )
    listed = api("staff").get("/api/v1/keys").json()
    assert sorted(k["usage"]["requests_today"] for k in listed) == [0, 1, 2, 3, 4]

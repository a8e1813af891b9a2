"""What staff set on a key or a team is a ceiling its owner may lower and never raise, lift or
leave (access.policies), through the API (DRF's client), the admin and the services; key
policies give new keys their defaults and hold every key under them to their ceilings."""

from __future__ import annotations

from typing import Any

import pytest

from access.models import GatewayKey, KeyPolicy
from access.services import key_create, key_set_limits, policy_set, team_add, team_members
from catalog.models import AuditEntry
from core.actor import Actor

pytestmark = pytest.mark.django_db

CEILING = "only staff raise or lift it (ask an administrator)"


def staff(users: dict[str, Any]) -> Actor:
    return Actor.for_user(users["staff"], "api")


def alices_key(users: dict[str, Any], **limits: Any) -> GatewayKey:
    return key_create(actor=Actor.for_user(users["alice"], "api"), name="bot", limits=limits)[0]


def patch(api: Any, who: str, key: GatewayKey, body: dict[str, Any]) -> Any:
    return api(who).patch(f"/api/v1/keys/{key.pk}/limits", body, format="json")


# -- what staff set on a key -------------------------------------------------------------------


def test_an_owner_lowers_a_limit_staff_set_and_cannot_raise_or_lift_it(
    api: Any, users: dict[str, Any]
) -> None:
    key = alices_key(users, rpm=1000)
    done = patch(api, "staff", key, {"rpm": 100, "tokens_per_day": 5000})
    assert done.status_code == 200, done.json()

    lifted = patch(api, "alice", key, {"tokens_per_day": 0})
    assert lifted.status_code == 403
    assert lifted.json() == {
        "detail": "The change was refused, nothing was changed: tokens_per_day: none (no limit) "
        "is above the ceiling of 5,000 that staff set on this key; you may lower it, and "
        f"{CEILING}.",
        "code": "above_ceiling",
        "problems": [
            {
                "field": "tokens_per_day",
                "message": "none (no limit) is above the ceiling of 5,000 that staff set on this "
                f"key; you may lower it, and {CEILING}",
            }
        ],
    }
    raised = patch(api, "alice", key, {"rpm": 500, "tpm": 10})
    assert raised.status_code == 403
    assert (
        "rpm: 500 is above the ceiling of 100 that staff set on this key"
        in (raised.json()["detail"])
    )
    key.refresh_from_db()
    assert (key.rpm, key.tpm, key.tokens_per_day) == (100, None, 5000)  # nothing half-written

    assert done.json()["ceilings"]["rpm"] == 100
    assert done.json()["ceilings"]["tokens_per_day"] == 5000
    entry = AuditEntry.objects.get(action="key-limits")
    assert (entry.actor_name, entry.changes["ceilings"]) == (
        "staff",
        [{}, {"rpm": 100, "tokens_per_day": 5000}],
    )
    assert patch(api, "alice", key, {"rpm": 50, "tokens_per_day": 10}).status_code == 200
    # Back up to the ceiling, not past it: the ceiling is what staff set, not the last figure.
    assert patch(api, "alice", key, {"rpm": 100}).status_code == 200
    assert patch(api, "alice", key, {"rpm": 101}).status_code == 403
    key.refresh_from_db()
    assert (key.rpm, key.tokens_per_day, key.ceilings) == (
        100,
        10,
        {"rpm": 100, "tokens_per_day": 5000},
    )
    # Staff lift it: the key has no ceiling of its own any more, and its owner may lift it too.
    assert patch(api, "staff", key, {"rpm": None}).json()["ceilings"]["rpm"] is None
    assert patch(api, "alice", key, {"rpm": 0}).status_code == 200


def test_models_and_an_expiry_staff_set_are_ceilings_too(api: Any, users: dict[str, Any]) -> None:
    key = alices_key(users)
    assert patch(api, "staff", key, {"models": ["llama-*"], "expires": "30d"}).status_code == 200
    every = patch(api, "alice", key, {"models": []})
    assert every.status_code == 403
    assert every.json()["problems"][0]["message"] == (
        "every model is wider than the models staff set on this key (llama-*); you may narrow "
        "them, and only staff widen them (ask an administrator)"
    )
    assert patch(api, "alice", key, {"models": ["qwen"]}).status_code == 403
    assert patch(api, "alice", key, {"models": ["llama-3b", "llama-*"]}).status_code == 200
    never = patch(api, "alice", key, {"expires": "none"})
    assert never.status_code == 403
    assert "expires: never is later than the expiry of" in never.json()["detail"]
    assert patch(api, "alice", key, {"expires": "60d"}).status_code == 403
    assert patch(api, "alice", key, {"expires": "1d"}).status_code == 200


def test_a_weight_staff_gave_a_key_is_its_owners_to_lower_and_raise_back(
    api: Any, users: dict[str, Any]
) -> None:
    key = alices_key(users)
    assert patch(api, "staff", key, {"weight": 4}).status_code == 200
    assert patch(api, "alice", key, {"weight": 2}).status_code == 200
    assert patch(api, "alice", key, {"weight": 4}).status_code == 200
    refused = patch(api, "alice", key, {"weight": 5})
    assert refused.status_code == 400
    assert (
        "weight: 5 is above the staff-given 4; only staff give a key a larger share"
        in (refused.json()["detail"])
    )


# -- teams: a member keeps their keys in --------------------------------------------------------


def test_a_member_cannot_take_a_key_out_of_a_team_with_a_policy(
    api: Any, users: dict[str, Any]
) -> None:
    team_add(actor=staff(users), name="research", members=["alice"])
    team_add(actor=staff(users), name="lounge", members=["alice"])  # no limits, no policy
    policy_set(actor=staff(users), scope="team:research", ceilings={"tokens_per_day": 5000})
    key = key_create(actor=Actor.for_user(users["alice"], "api"), name="bot", team="research")[0]

    out = patch(api, "alice", key, {"team": None})
    assert out.status_code == 403
    assert out.json()["detail"] == (
        "The change was refused, nothing was changed: team: no team is not one of your teams "
        "with limits (research): a key of yours stays in one of them, and only staff put a key "
        "elsewhere (ask an administrator)."
    )
    lounge = patch(api, "alice", key, {"team": "lounge"})
    assert lounge.status_code == 403
    assert (
        "team: the team lounge, which holds no limits, is not one of your teams"
        in (lounge.json()["detail"])
    )
    assert GatewayKey.objects.get().team.name == "research"
    # Staff may; and a member removed from the team may take their key out.
    assert patch(api, "staff", key, {"team": "none"}).json()["team"] is None
    assert patch(api, "staff", key, {"team": "research"}).status_code == 200
    team_members(actor=staff(users), name="research", remove=["alice"])
    assert patch(api, "alice", key, {"team": None}).json()["team"] is None


def test_a_team_with_limits_holds_its_members_keys_even_without_a_policy(
    api: Any, users: dict[str, Any]
) -> None:
    team_add(actor=staff(users), name="research", limits={"rpm": 100}, members=["alice"])
    made = api("alice").post("/api/v1/keys", {"name": "bot"}, format="json")
    assert made.status_code == 201 and made.json()["team"] == "research"
    assert patch(api, "alice", GatewayKey.objects.get(), {"team": None}).status_code == 403


def test_a_members_new_key_gets_the_teams_defaults_and_stays_within_its_ceilings(
    api: Any, users: dict[str, Any]
) -> None:
    team_add(actor=staff(users), name="research", members=["alice"])
    policy_set(
        actor=staff(users),
        scope="team:research",
        defaults={"rpm": 60},
        ceilings={"rpm": 100, "tokens_per_day": 10000},
    )
    made = api("alice").post("/api/v1/keys", {"name": "bot", "tpm": 500}, format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert body["team"] == "research" and body["policy"] == "team:research"
    # rpm: the default; tokens_per_day: no default, so the ceiling; tpm: as given.
    assert (body["limits"]["rpm"], body["limits"]["tokens_per_day"], body["limits"]["tpm"]) == (
        60,
        10000,
        500,
    )
    assert body["ceilings"]["rpm"] == 100 and body["ceilings"]["tokens_per_day"] == 10000

    over = api("alice").post("/api/v1/keys", {"name": "big", "rpm": 500}, format="json")
    assert over.status_code == 403
    assert over.json()["detail"] == (
        "The key was refused, nothing was changed: rpm: 500 is above the ceiling of 100 that the "
        f"team research's key policy sets; you may lower it, and {CEILING}."
    )
    unlimited = api("alice").post(
        "/api/v1/keys", {"name": "big", "tokens_per_day": 0}, format="json"
    )
    assert unlimited.status_code == 403
    outside = api("alice").post("/api/v1/keys", {"name": "big", "team": None}, format="json")
    assert outside.status_code == 403
    assert (
        "team: no team is not one of your teams with limits (research)"
        in (outside.json()["detail"])
    )
    assert GatewayKey.objects.count() == 1  # nothing half-made
    key = GatewayKey.objects.get()
    assert patch(api, "alice", key, {"rpm": 100}).status_code == 200
    assert patch(api, "alice", key, {"rpm": 101}).status_code == 403


def test_a_member_of_several_teams_with_limits_says_which(api: Any, users: dict[str, Any]) -> None:
    team_add(actor=staff(users), name="research", limits={"rpm": 10}, members=["alice"])
    team_add(actor=staff(users), name="support", limits={"rpm": 10}, members=["alice"])
    refused = api("alice").post("/api/v1/keys", {"name": "bot"}, format="json")
    assert refused.status_code == 400
    assert refused.json()["detail"] == (
        "The key was refused, nothing was changed: team: you are a member of research, support, "
        "whose limits hold your keys: say which team the key is in (like team research)."
    )
    made = api("alice").post("/api/v1/keys", {"name": "bot", "team": "support"}, format="json")
    assert made.json()["team"] == "support"
    # Between two of their teams with limits, a member moves a key as they like.
    assert patch(api, "alice", GatewayKey.objects.get(), {"team": "research"}).status_code == 200


# -- the user's and the default policy ------------------------------------------------------------


def test_keys_in_no_team_follow_their_owners_policy_else_the_default(
    api: Any, users: dict[str, Any]
) -> None:
    policy_set(actor=staff(users), scope="default", ceilings={"rpm": 10})
    policy_set(actor=staff(users), scope="user:bob", defaults={"rpm": 20}, ceilings={"rpm": 50})
    alice = api("alice").post("/api/v1/keys", {"name": "a"}, format="json").json()
    bob = api("bob").post("/api/v1/keys", {"name": "b"}, format="json").json()
    assert (alice["limits"]["rpm"], alice["policy"]) == (10, "default")
    assert (bob["limits"]["rpm"], bob["policy"]) == (20, "user:bob")
    refused = api("bob").patch(f"/api/v1/keys/{bob['id']}/limits", {"rpm": 60}, format="json")
    assert refused.status_code == 403
    assert (
        "rpm: 60 is above the ceiling of 50 that bob's key policy sets"
        in (refused.json()["detail"])
    )
    assert (
        api("alice")
        .patch(f"/api/v1/keys/{alice['id']}/limits", {"rpm": 11}, format="json")
        .json()["detail"]
        .startswith(
            "The change was refused, nothing was changed: rpm: 11 is above the ceiling of 10 that "
            "the default key policy sets"
        )
    )
    # Staff's own keys are held to none of it (they set it).
    mine = api("staff").post("/api/v1/keys", {"name": "s", "rpm": 1000}, format="json")
    assert mine.status_code == 201 and mine.json()["limits"]["rpm"] == 1000


def test_a_lowered_ceiling_lowers_the_keys_under_it_each_in_the_audit(
    users: dict[str, Any],
) -> None:
    team_add(actor=staff(users), name="research", members=["alice", "bob"])
    alice = Actor.for_user(users["alice"], "api")
    unlimited = key_create(actor=alice, name="a", team="research")[0]
    high = key_create(actor=alice, name="b", team="research", limits={"rpm": 500})[0]
    low = key_create(actor=alice, name="c", team="research", limits={"rpm": 5})[0]
    exempt = key_create(actor=alice, name="d", team="research")[0]
    key_set_limits(actor=staff(users), key_id=exempt.pk, changes={"rpm": 1000})
    revoked = key_create(actor=alice, name="e", team="research")[0]
    revoked.revoked_at = revoked.created_at
    revoked.save()
    elsewhere = key_create(actor=Actor.for_user(users["bob"], "api"), name="f")[0]

    _, lowered = policy_set(actor=staff(users), scope="team:research", ceilings={"rpm": 100})
    assert lowered == 2
    rpm = dict(GatewayKey.objects.values_list("pk", "rpm"))
    assert (rpm[unlimited.pk], rpm[high.pk], rpm[low.pk]) == (100, 100, 5)
    # A limit staff set on the key itself is its own ceiling; revoked keys open nothing.
    assert (rpm[exempt.pk], rpm[revoked.pk], rpm[elsewhere.pk]) == (1000, None, None)
    entries = AuditEntry.objects.filter(action="key-limits", note__startswith="lowered")
    assert sorted(e.model_name for e in entries) == sorted(
        [f"key #{unlimited.pk}", f"key #{high.pk}"]
    )
    assert {(e.actor_name, e.note) for e in entries} == {
        ("staff", "lowered to the ceilings of the team research's key policy")
    }
    assert entries.get(model_name=f"key #{high.pk}").changes["rpm"] == [500, 100]
    entry = AuditEntry.objects.get(action="key-policy")
    assert (entry.model_name, entry.note) == (
        "key policy team:research",
        "2 key(s) lowered to its ceilings",
    )
    assert entry.after == {"scope": "team:research", "defaults": {}, "ceilings": {"rpm": 100}}


def test_a_policys_default_is_at_most_its_ceiling_and_only_staff_set_one(
    users: dict[str, Any],
) -> None:
    from core.refusals import Refused

    with pytest.raises(Refused) as refused:
        policy_set(
            actor=staff(users), scope="default", defaults={"rpm": 200}, ceilings={"rpm": 100}
        )
    assert str(refused.value) == (
        "The policy was refused, nothing was changed: defaults.rpm: 200 is above its ceiling of "
        "100; a new key's default is at most the ceiling."
    )
    with pytest.raises(Refused, match=r"Only staff may set key policies; ask an administrator\."):
        policy_set(
            actor=Actor.for_user(users["alice"], "api"), scope="default", ceilings={"rpm": 1}
        )
    with pytest.raises(Refused, match="There is no team named 'nope'"):
        policy_set(actor=staff(users), scope="team:nope", ceilings={"rpm": 1})
    with pytest.raises(Refused, match="'teams' is not a key policy: name one as default"):
        policy_set(actor=staff(users), scope="teams", ceilings={"rpm": 1})
    assert not KeyPolicy.objects.exists()


# -- the API of key policies ----------------------------------------------------------------------


def test_staff_set_read_and_remove_key_policies_through_the_api(
    api: Any, users: dict[str, Any]
) -> None:
    team_add(actor=staff(users), name="research", members=["alice"])
    alices = alices_key(users, team="research")
    response = api("staff").patch(
        "/api/v1/keys/policies/team:research",
        {"defaults": {"rpm": 30}, "ceilings": {"rpm": 60, "tpm": 1000}},
        format="json",
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["scope"], body["lowered"]) == ("team:research", 1)
    assert body["defaults"]["rpm"] == 30 and body["ceilings"] == {
        "rpm": 60,
        "tpm": 1000,
        "max_parallel": None,
        "tokens_per_day": None,
        "tokens_per_month": None,
    }
    alices.refresh_from_db()
    assert (alices.rpm, alices.tpm) == (60, 1000)
    # A figure not sent stays; null takes it away.
    again = api("staff").patch(
        "/api/v1/keys/policies/team:research", {"ceilings": {"tpm": None}}, format="json"
    )
    assert again.json()["ceilings"]["rpm"] == 60 and again.json()["ceilings"]["tpm"] is None
    team = api("alice").get("/api/v1/teams/research").json()
    assert team["policy"]["defaults"]["rpm"] == 30 and team["policy"]["ceilings"]["rpm"] == 60

    assert [p["scope"] for p in api("alice").get("/api/v1/keys/policies").json()] == [
        "team:research"
    ]
    assert api("bob").get("/api/v1/keys/policies/team:research").status_code == 404
    refused = api("alice").patch(
        "/api/v1/keys/policies/team:research", {"ceilings": {"rpm": 1000}}, format="json"
    )
    assert refused.status_code == 403
    assert refused.json()["detail"] == "Only staff may set key policies; ask an administrator."
    unknown = api("staff").patch(
        "/api/v1/keys/policies/default", {"ceilings": {"colour": 1}}, format="json"
    )
    assert unknown.status_code == 400

    gone = api("staff").delete("/api/v1/keys/policies/team:research")
    assert gone.json() == {"scope": "team:research"}
    assert not KeyPolicy.objects.exists()
    assert [e.action for e in AuditEntry.objects.filter(model_name__startswith="key policy")] == [
        "key-policy-remove",
        "key-policy",
        "key-policy",
    ]
    assert api("staff").delete("/api/v1/keys/policies/team:research").status_code == 404


# -- the admin ------------------------------------------------------------------------------------


def _key_form(key: GatewayKey, **fields: Any) -> dict[str, Any]:
    form: dict[str, Any] = {
        "team": key.team_id or "",
        "expires_at_0": "",
        "expires_at_1": "",
        **{name: getattr(key, name) or "" for name in ("rpm", "tpm", "max_parallel")},
        **{name: getattr(key, name) or "" for name in ("tokens_per_day", "tokens_per_month")},
        "models": ", ".join(key.models),
        "weight": key.weight,
    }
    return {**form, **fields}


def test_what_the_admin_sets_on_a_key_is_its_ceiling(
    client: Any, api: Any, users: dict[str, Any]
) -> None:
    from django.contrib.auth import get_user_model

    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    key = alices_key(users)
    client.force_login(root)
    url = f"/admin/access/gatewaykey/{key.pk}/change/"
    assert client.post(url, _key_form(key, tokens_per_day=5000)).status_code == 302
    key.refresh_from_db()
    assert key.ceilings == {"tokens_per_day": 5000}
    page = client.get(url).content.decode()
    assert "tokens_per_day 5000 (staff set on this key)" in page
    assert patch(api, "alice", key, {"tokens_per_day": None}).status_code == 403


def test_the_admin_sets_and_removes_key_policies_through_the_services(
    client: Any, users: dict[str, Any]
) -> None:
    from django.contrib.auth import get_user_model

    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    key = alices_key(users, rpm=500)
    client.force_login(root)
    assert client.get("/admin/access/keypolicy/add/").status_code == 200
    refused = client.post(
        "/admin/access/keypolicy/add/", {"kind": "default", "default_rpm": "50", "max_rpm": "20"}
    )
    assert refused.status_code == 200
    assert "50 is above its ceiling of 20" in refused.content.decode()
    assert not KeyPolicy.objects.exists()

    done = client.post(
        "/admin/access/keypolicy/add/",
        {"kind": "default", "default_rpm": "10", "max_rpm": "20"},
        follow=True,
    )
    assert "1 key(s) above a ceiling were lowered to it." in done.content.decode()
    policy = KeyPolicy.objects.get()
    assert (policy.defaults, policy.ceilings) == ({"rpm": 10}, {"rpm": 20})
    key.refresh_from_db()
    assert key.rpm == 20
    entry = AuditEntry.objects.get(action="key-policy")
    assert (entry.actor_name, entry.door) == ("root", "admin")

    url = f"/admin/access/keypolicy/{policy.pk}/change/"
    assert client.get(url).status_code == 200
    changed = client.post(url, {"kind": "default", "default_rpm": "", "max_rpm": "30"})
    assert changed.status_code == 302
    policy.refresh_from_db()
    assert (policy.defaults, policy.ceilings) == ({}, {"rpm": 30})
    assert client.get("/admin/access/keypolicy/").status_code == 200

    removed = client.post(f"/admin/access/keypolicy/{policy.pk}/delete/", {"post": "yes"})
    assert removed.status_code == 302
    assert not KeyPolicy.objects.exists()
    assert AuditEntry.objects.get(action="key-policy-remove").door == "admin"

"""The Keys and Teams pages: what staff set is a ceiling the key's owner may lower and never
raise, lift or leave; staff set teams' and the default key policy there."""

from __future__ import annotations

from typing import Any

import pytest

from access.models import GatewayKey, KeyPolicy
from access.services import key_create, key_set_limits, policy_set, team_add
from catalog.models import AuditEntry
from core.actor import Actor
from tests.console.pages import KEY_LIMITS_UNCHANGED, text_of

pytestmark = [pytest.mark.django_db]

HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/keys/"}
EMPTY = KEY_LIMITS_UNCHANGED


def staff(users: dict[str, Any]) -> Actor:
    return Actor.for_user(users["staff"], "console")


def test_an_owner_cannot_lift_a_budget_staff_set_in_the_console(
    client_for: Any, users: dict[str, Any]
) -> None:
    key = key_create(actor=Actor.for_user(users["alice"], "console"), name="bot")[0]
    set_by_staff = client_for("staff").post(
        f"/keys/{key.pk}/limits", {**EMPTY, "tokens_per_day": "5000"}, headers=HTMX
    )
    assert set_by_staff.status_code == 200, text_of(set_by_staff)

    form = {**EMPTY, "tokens_per_day": "5000"}
    lifted = client_for("alice").post(
        f"/keys/{key.pk}/limits", {**form, "tokens_per_day": "none"}, headers=HTMX
    )
    assert lifted.status_code == 403
    assert (
        "tokens_per_day: none (no limit) is above the ceiling of 5,000 that staff set on this "
        "key; you may lower it, and only staff raise or lift it (ask an administrator)"
    ) in text_of(lifted)
    key.refresh_from_db()
    assert key.tokens_per_day == 5000
    page = text_of(client_for("alice").get("/keys/"))
    assert "Ceilings, which the owner may lower and only staff raise: Tokens per day 5,000" in page
    lowered = client_for("alice").post(
        f"/keys/{key.pk}/limits", {**form, "tokens_per_day": "1000"}, headers=HTMX
    )
    assert lowered.status_code == 200
    key.refresh_from_db()
    assert key.tokens_per_day == 1000
    entry = AuditEntry.objects.filter(action="key-limits").first()
    assert entry is not None and (entry.actor_name, entry.door) == ("alice", "console")


def test_a_members_new_key_goes_into_their_team_with_its_defaults(
    client_for: Any, users: dict[str, Any]
) -> None:
    team_add(actor=staff(users), name="research", members=["alice"])
    policy_set(
        actor=staff(users), scope="team:research", defaults={"rpm": 30}, ceilings={"rpm": 60}
    )
    page = client_for("alice").get("/keys/").content.decode()
    # No "no team" to choose: a member's keys stay in their teams with limits.
    create_form = page.split('id="key-create-form"')[1].split("</form>")[0]
    assert '<option value="">no team</option>' not in create_form
    assert '<option value="research"' in create_form

    made = client_for("alice").post("/keys/create", {"name": "bot"}, headers=HTMX)
    assert made.status_code == 201, text_of(made)
    key = GatewayKey.objects.get()
    assert (key.team.name, key.rpm) == ("research", 30)
    over = client_for("alice").post("/keys/create", {"name": "big", "rpm": "500"}, headers=HTMX)
    assert over.status_code == 403
    assert "rpm: 500 is above the ceiling of 60 that the team research's key policy sets" in (
        text_of(over)
    )
    outside = client_for("alice").post(
        f"/keys/{key.pk}/limits", {**EMPTY, "rpm": "30", "team": ""}, headers=HTMX
    )
    assert outside.status_code == 403
    assert "team: no team is not one of your teams with limits (research)" in text_of(outside)
    assert GatewayKey.objects.get().team.name == "research"


def test_staff_set_a_teams_key_policy_and_members_see_it(
    client_for: Any, users: dict[str, Any]
) -> None:
    team_add(actor=staff(users), name="research", members=["alice"])
    key = key_create(actor=Actor.for_user(users["alice"], "console"), name="bot", team="research")[
        0
    ]
    headers = {"HX-Request": "true", "HX-Current-URL": "http://testserver/teams/"}
    done = client_for("staff").post(
        "/teams/research/policy",
        {"default_tpm": "500", "max_tpm": "1000", "max_tokens_per_day": "20000"},
        headers=headers,
    )
    assert done.status_code == 200, text_of(done)
    assert done.content.decode().lstrip().startswith('<article class="card key team"')
    assert (
        "Key policy in force now: new keys get its defaults. 1 key(s) above a ceiling were "
        "lowered to it."
    ) in text_of(done)
    key.refresh_from_db()
    assert (key.tpm, key.tokens_per_day) == (1000, 20000)
    member = text_of(client_for("alice").get("/teams/"))
    assert (
        "Key policy, for each key in the team: Tokens per minute default 500, ceiling 1,000 · "
        "Tokens per day ceiling 20,000"
    ) in member

    refused = client_for("staff").post(
        "/teams/research/policy", {"default_tpm": "5000", "max_tpm": "1000"}, headers=headers
    )
    assert refused.status_code == 400
    assert "5,000 is above its ceiling of 1,000" in text_of(refused)
    forbidden = client_for("alice").post(
        "/teams/research/policy", {"max_tpm": "100000"}, headers=headers
    )
    assert forbidden.status_code == 403
    assert "Only staff may set key policies; ask an administrator." in text_of(forbidden)
    assert KeyPolicy.objects.get().ceilings == {"tpm": 1000, "tokens_per_day": 20000}


def test_staff_set_the_default_key_policy(client_for: Any, users: dict[str, Any]) -> None:
    key = key_create(actor=Actor.for_user(users["bob"], "console"), name="bot")[0]
    mine = key_create(actor=Actor.for_user(users["carol"], "console"), name="c")[0]
    key_set_limits(actor=staff(users), key_id=mine.pk, changes={"rpm": 500})  # its own ceiling
    headers = {"HX-Request": "true", "HX-Current-URL": "http://testserver/teams/"}
    done = client_for("staff").post("/teams/policy", {"max_rpm": "100"}, headers=headers)
    assert done.status_code == 200, text_of(done)
    assert "1 key(s) above a ceiling were lowered to it." in text_of(done)
    assert "The default key policy, for every user's keys in no team" in text_of(done)
    assert "Requests per minute ceiling 100" in text_of(done)
    key.refresh_from_db()
    mine.refresh_from_db()
    assert (key.rpm, mine.rpm) == (100, 500)
    refused = client_for("bob").post("/teams/policy", {"max_rpm": "0"}, headers=headers)
    assert refused.status_code == 403
    assert "Only staff may set key policies; ask an administrator." in text_of(refused)
    assert KeyPolicy.objects.get().ceilings == {"rpm": 100}

"""`llmgw ctl key limits`, `key create` and `key policy` against a running server: what staff set
is a ceiling the key's owner may lower and never raise, lift or leave."""

from __future__ import annotations

import json
from typing import Any

import pytest

from access.models import GatewayKey, KeyPolicy
from access.services import key_create, policy_set, team_add
from catalog.models import AuditEntry
from core.actor import Actor
from tests.support.ctl import Ctl, ctl_as

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


def test_an_owner_lowers_what_staff_set_and_cannot_lift_it(ctl: Ctl, users: dict[str, Any]) -> None:
    key = key_create(actor=Actor.for_user(users["alice"], "cli"), name="bot")[0]
    code, by_staff, err = ctl("staff", "key", "limits", str(key.pk), "--tokens-per-day", "5000")
    assert code == 0, err

    code, out, err = ctl("alice", "key", "limits", str(key.pk), "--tokens-per-day", "none")
    assert (code, out) == (1, "")
    assert err == (
        "error: The change was refused, nothing was changed: tokens_per_day: none (no limit) is "
        "above the ceiling of 5,000 that staff set on this key; you may lower it, and only staff "
        "raise or lift it (ask an administrator).\n"
    )
    code, _, err = ctl("alice", "key", "limits", str(key.pk), "--tokens-per-day", "9000")
    assert code == 1 and "tokens_per_day: 9,000 is above the ceiling of 5,000" in err
    code, out, err = ctl("alice", "key", "limits", str(key.pk), "--tokens-per-day", "100")
    assert code == 0, err
    assert "  tokens-per-day    100 tokens/day (0 used of 100)\n" in out
    key.refresh_from_db()
    assert (key.tokens_per_day, key.ceilings) == (100, {"tokens_per_day": 5000})
    assert "  ceilings          tokens-per-day 5,000 (the owner may lower, not raise)\n" in by_staff
    assert AuditEntry.objects.filter(action="key-limits").count() == 2  # refusals write nothing


def test_a_member_keeps_their_keys_in_the_team_and_gets_its_defaults(
    ctl: Ctl, users: dict[str, Any]
) -> None:
    staff = Actor.for_user(users["staff"], "cli")
    team_add(actor=staff, name="research", members=["alice"])
    policy_set(actor=staff, scope="team:research", defaults={"rpm": 60}, ceilings={"rpm": 100})
    code, out, err = ctl("alice", "key", "create", "bot")
    assert code == 0, err
    assert "  team              research\n" in out
    assert "  rpm               60 requests/min (0 used of 60 in the last minute)\n" in out
    assert (
        "  ceilings          rpm 100 (the owner may lower, not raise; key policy team:research)\n"
        in out
    )
    key = GatewayKey.objects.get()
    code, out, err = ctl("alice", "key", "limits", str(key.pk), "--team", "none")
    assert (code, out) == (1, "")
    assert err == (
        "error: The change was refused, nothing was changed: team: no team is not one of your "
        "teams with limits (research): a key of yours stays in one of them, and only staff put "
        "a key elsewhere (ask an administrator).\n"
    )
    code, _, err = ctl("alice", "key", "create", "big", "--rpm", "500")
    assert code == 1 and "rpm: 500 is above the ceiling of 100 that the team research's" in err
    assert GatewayKey.objects.count() == 1


def test_staff_set_show_and_remove_a_key_policy(ctl: Ctl, users: dict[str, Any]) -> None:
    team_add(actor=Actor.for_user(users["staff"], "cli"), name="research", members=["alice"])
    key = key_create(actor=Actor.for_user(users["alice"], "cli"), name="bot", team="research")[0]
    code, out, err = ctl(
        "staff",
        "key",
        "policy",
        "team:research",
        "--default-rpm",
        "60",
        "--max-rpm",
        "100",
        "--max-tokens-per-day",
        "1,000,000",
    )
    assert code == 0, err
    assert out.splitlines() == [
        "Key policy team:research now:",
        "  rpm               default 60, ceiling 100 (requests/min)",
        "  tpm               no default, no ceiling (tokens/min)",
        "  max-parallel      no default, no ceiling (in flight)",
        "  tokens-per-day    no default, ceiling 1,000,000 (tokens/day)",
        "  tokens-per-month  no default, no ceiling (tokens/month)",
        "1 key(s) under it were above a ceiling and are lowered to it. New keys get its "
        "defaults; the gateway holds the lowered limits within a second.",
    ]
    key.refresh_from_db()
    assert (key.rpm, key.tokens_per_day) == (100, 1_000_000)
    entry = AuditEntry.objects.get(action="key-policy")
    assert (entry.actor_name, entry.door) == ("staff", "cli")

    code, out, _ = ctl("alice", "key", "policies")
    assert out.splitlines()[1].split() == [
        "team:research",
        "rpm",
        "60",
        "rpm",
        "100,",
        "tokens-per-day",
        "1,000,000",
    ]
    code, out, _ = ctl("alice", "team", "show", "research")
    assert (
        "  key policy        rpm default 60, ceiling 100; tokens-per-day ceiling 1,000,000\n" in out
    )
    code, out, _ = ctl("alice", "key", "policy", "team:research", "--json")
    assert json.loads(out)["ceilings"]["rpm"] == 100
    code, _, err = ctl("alice", "key", "policy", "team:research", "--max-rpm", "1000")
    assert (code, err) == (1, "error: Only staff may set key policies; ask an administrator.\n")

    code, out, err = ctl("staff", "key", "policy", "team:research", "--remove")
    assert (code, out) == (0, "Key policy team:research removed; its keys keep their limits.\n")
    assert not KeyPolicy.objects.exists()
    code, out, _ = ctl("staff", "key", "policies")
    assert (
        out == "No key policies. Staff set one with: llmgw ctl key policy default --max-rpm N ...\n"
    )

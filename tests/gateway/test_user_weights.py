"""A person's weight in the fair queue (gateway.UserWeight): set and cleared by staff through the
CLI, the API and the admin, audited, refused to others and for bad values, and read by the
gateway with its snapshot, where the fair queue shares a team's slots by it
(tests/gateway/test_fairqueue.py has the order itself)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from access.models import UserWeight
from access.services import user_weight_set
from catalog.models import AuditEntry
from core.actor import Actor
from core.refusals import Refused
from gateway.state import read_user_weights
from tests.support.ctl import Ctl, ctl_as

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


def test_staff_set_show_and_clear_a_persons_weight_from_the_command_line(
    ctl: Ctl, users: dict[str, Any]
) -> None:
    code, out, err = ctl("staff", "key", "weights")
    assert (code, out) == (0, "Nobody has a weight of their own. Staff set one with: llmgw ctl "
                               "key weight USER N\n"), err  # fmt: skip
    code, out, err = ctl("staff", "key", "weight", "alice", "3")
    assert (code, out) == (0, "alice now weighs 3 in the fair queue.\n"), err
    assert read_user_weights() == {users["alice"].pk: 3.0}
    code, out, err = ctl("staff", "key", "weights", "--json")
    assert json.loads(out) == {"people": [{"user": "alice", "weight": 3.0}]}
    code, out, err = ctl("staff", "key", "weight", "alice", "--clear")
    assert code == 0 and "alice has no weight of their own now" in out, err
    assert read_user_weights() == {}
    changes = AuditEntry.objects.filter(action="user-weight").order_by("pk")
    assert [(e.before, e.after) for e in changes] == [
        (None, {"weight": 3.0}),
        ({"weight": 3.0}, None),
    ]


def test_only_staff_set_a_weight_and_bad_ones_change_nothing(
    ctl: Ctl, users: dict[str, Any]
) -> None:
    code, out, err = ctl("alice", "key", "weight", "alice", "50")
    assert (code, out) == (1, "")
    assert "only staff" in err.lower() or "staff" in err, err
    for bad, said in (("0", "weight: is a number above 0 and at most 1000, not 0"),
                      ("5000", "weight: is a number above 0 and at most 1000, not 5000")):  # fmt: skip
        code, _, err = ctl("staff", "key", "weight", "alice", bad)
        assert code == 1 and said in err, err
    code, _, err = ctl("staff", "key", "weight", "nobody-here", "2")
    assert code == 1 and "user: there is no user named 'nobody-here'" in err, err
    code, _, err = ctl("staff", "key", "weight", "alice")
    assert code == 1 and "give a weight" in err, err
    assert not UserWeight.objects.exists()
    assert not AuditEntry.objects.filter(action="user-weight").exists()


def test_a_member_sees_only_their_own_weight(users: dict[str, Any], tokens: dict[str, str]) -> None:
    staff = Actor.for_user(users["staff"], "api")
    user_weight_set(actor=staff, username="alice", weight=2)
    user_weight_set(actor=staff, username="bob", weight=4)
    seen = Client().get("/api/v1/keys/weights", HTTP_AUTHORIZATION=f"Token {tokens['alice']}")
    assert seen.status_code == 200
    assert seen.json() == {"people": [{"user": "alice", "weight": 2.0}]}
    refused = Client().put(
        "/api/v1/keys/weights/bob",
        data=json.dumps({"weight": 1, "extra": 1}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {tokens['staff']}",
    )
    assert refused.status_code == 400  # an unknown field: nothing changed
    assert read_user_weights() == {users["alice"].pk: 2.0, users["bob"].pk: 4.0}
    with pytest.raises(Refused) as blank:
        user_weight_set(actor=staff, username=" ", weight=2)
    assert blank.value.status == 400


def test_staff_set_a_weight_in_the_admin(users: dict[str, Any]) -> None:
    from django.contrib.auth import get_user_model

    root = get_user_model().objects.create_superuser("root", password="root-password-1")
    browser = Client()
    browser.force_login(root)
    answer = browser.post(
        "/admin/access/userweight/add/", {"user": users["bob"].pk, "weight": "2.5"}
    )
    assert answer.status_code == 302, answer.content[:2000]
    assert read_user_weights() == {users["bob"].pk: 2.5}
    entry = AuditEntry.objects.get(action="user-weight")
    assert (entry.after, entry.actor_name, entry.door) == ({"weight": 2.5}, "root", "admin")

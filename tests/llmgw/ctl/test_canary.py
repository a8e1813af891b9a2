"""`llmgw ctl model update --canary ...` and `llmgw ctl model canary show|promote|abort` against a
live server; a canary under way is written straight into the model here (tests/registry/
test_canary.py and tests/test_canary_e2e.py run real ones)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from catalog.models import AuditEntry, Model
from tests.factories import canary_record, definition
from tests.llmgw.ctl.test_commands import ctl  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db(transaction=True)

WATCHING = canary_record()


@pytest.fixture
def chat(users: dict[str, Any]) -> Model:
    from catalog.definitions import clean_definition
    from catalog.services import model_add
    from core.actor import Actor

    model = model_add(
        actor=Actor.for_user(users["alice"], "api"),
        definition=clean_definition(definition("chat")),
        source_check=False,
    )
    Model.objects.filter(pk=model.pk).update(canary=WATCHING)
    return model


def test_show_prints_the_state_and_both_revisions_figures(ctl: Any, chat: Model) -> None:  # noqa: F811
    code, out, err = ctl("bob", "model", "canary", "show", "chat")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "chat: canary of e4f5a6b (from a1b2c3d), watching"
    assert lines[1] == "  20% of the requests for 10m (window 00:10:00 - 00:20:00 UTC), 4 checks"
    assert lines[2] == (
        "  rolled back when server errors exceed 5.0% or latency is 2 times the old revision's"
    )
    assert lines[3].split() == [
        "REVISION",
        "COMMIT",
        "REQUESTS",
        "SERVER",
        "ERRORS",
        "MEAN",
        "LATENCY",
    ]
    assert lines[4].split() == ["old", "a1b2c3d", "80", "0", "(0.0%)", "0.200", "s"]
    assert lines[5].split() == ["new", "e4f5a6b", "20", "1", "(5.0%)", "0.250", "s"]
    assert lines[6] == "  last check: healthy so far: 1 server errors in 20 answers (5.0%)"
    code, out, _ = ctl("bob", "model", "canary", "show", "chat", "--json")
    assert json.loads(out)["new"] == {
        "requests": 20,
        "server_errors": 1,
        "error_rate": 0.05,
        "mean_latency": 0.25,
    }


def test_model_updates_shows_a_canary_under_way(ctl: Any, chat: Model) -> None:  # noqa: F811
    code, out, err = ctl("bob", "model", "updates")
    assert code == 0, err
    assert out.startswith("chat: canary of e4f5a6b (from a1b2c3d), watching\n")
    assert "Every served model is on the newest files" not in out
    code, out, err = ctl("bob", "model", "updates", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["updates"] == []
    [under_way] = shown["canaries"]
    assert (under_way["model"], under_way["state"], under_way["new"]["requests"]) == (
        "chat",
        "watching",
        20,
    )


def test_promote_and_abort_are_the_owners_or_staffs(ctl: Any, chat: Model) -> None:  # noqa: F811
    code, _, err = ctl("bob", "model", "canary", "abort", "chat")
    assert code == 1
    assert err.startswith("error: chat belongs to alice; only they or a staff user may change it.")
    assert Model.objects.get(name="chat").canary["state"] == "watching"

    code, out, err = ctl("alice", "model", "canary", "promote", "chat")
    assert code == 0, err
    assert out.splitlines()[0] == "chat: canary of e4f5a6b (from a1b2c3d), promoted"
    assert "  promoted by alice: promoted by alice" in out
    entry = AuditEntry.objects.get(action="canary-promote")
    assert (entry.actor_name, entry.door) == ("alice", "cli")

    code, _, err = ctl("staff", "model", "canary", "abort", "chat")
    assert code == 1 and "chat has no canary under way (the last one was promoted)" in err


def test_abort_by_staff(ctl: Any, chat: Model) -> None:  # noqa: F811
    code, out, err = ctl("staff", "model", "canary", "abort", "chat")
    assert code == 0, err
    assert "aborted by staff: aborted by staff" in out
    assert "the old replicas, which never stopped, serve on" in out
    entry = AuditEntry.objects.get(action="canary-rollback")
    assert (entry.actor_name, entry.door) == ("staff", "cli")
    assert "old revision: 80 requests, 0 server errors, mean latency 0.200 s" in entry.note


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--canary", "0"], "canary: must be a whole percentage from 1 to 99"),
        (["--canary", "10", "--for", "3s"], "--for must be between 10s and 1d (got '3s')"),
        (
            ["--canary", "10", "--max-error-rate", "1.5"],
            "max_error_rate: must be a fraction from 0 up to (not including) 1",
        ),
        (["--for", "10m"], "--for only mean something for a canary update; add --canary PERCENT"),
    ],
)
def test_update_refuses_bad_canary_flags(ctl: Any, chat: Model, argv: list[str], says: str) -> None:  # noqa: F811
    code, _, err = ctl("alice", "model", "update", "chat", *argv)
    assert code == 1 and says in err, err


def test_non_finite_numbers_are_refused_before_asking(ctl: Any, chat: Model, capsys: Any) -> None:  # noqa: F811
    with pytest.raises(SystemExit) as exited:
        ctl("alice", "model", "update", "chat", "--canary", "10", "--max-latency-ratio", "nan")
    assert exited.value.code == 2
    assert "'nan' is not a finite number" in capsys.readouterr().err

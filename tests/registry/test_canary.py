"""Canary updates against the database and olah: the canary replica beside the old ones, the
checks on the gateway's figures per revision, automatic rollback and promotion, and promote and
abort by hand. The agents are heartbeats (tests.support.fleet); tests/test_canary_e2e.py runs
the same with real engines."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from access.canary import check_canaries
from access.traffic import TrafficBook
from catalog.models import AuditEntry, Model
from core.actor import Actor
from core.dbclock import database_now
from core.refusals import Refused
from fleet.models import Replica
from fleet.reconciler import reconcile_pass
from fleet.specs import current_keys, replica_revision
from llmgw.tinygguf import write_tiny_model
from registry import canary, fetches
from registry.canary import check as canary_check
from registry.models import Rollout
from registry.rollouts import advance_rollouts, start_rollback
from registry.updates import check_updates, serve_start
from tests.support.fleet import Fleet
from tests.support.registry import LocalRegistry, available

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

REPO = "acme/tiny-chat-GGUF"
NAME = "tiny-chat-q4"


@pytest.fixture
def world(
    tmp_path: Path, server_yaml: Any, users: dict[str, Any], settings: Any
) -> Iterator[dict[str, Any]]:
    settings.LLMGW_CANARY_MIN_REQUESTS = 10
    settings.LLMGW_KICK_RECONCILE = False
    weights = {}
    for seed in (1, 2):
        weights[seed] = tmp_path / f"weights-{seed}.gguf"
        write_tiny_model(weights[seed], seed=seed)
    with LocalRegistry(tmp_path / "registry") as registry:
        registry.commit(REPO, {"tiny-chat-q4.gguf": weights[1]})
        server_yaml(
            {
                "registry": {"endpoint": registry.endpoint},
                "mirror": {"root": str(tmp_path / "mirror")},
            }
        )
        alice = Actor.for_user(users["alice"], "cli")
        fleet = Fleet(users["staff"], users["alice"])
        fleet.node("a", memory_gb=8)
        fleet.node("b", memory_gb=8)
        fetch = serve_start(actor=alice, repo=REPO, min_replicas=2)
        fetches.run_fetch(fetch.pk)
        settle(fleet)
        registry.commit(REPO, {"tiny-chat-q4.gguf": weights[2]})
        check_updates()
        yield {"fleet": fleet, "alice": alice, "users": users}


def settle(fleet: Fleet, passes: int = 10) -> None:
    for _ in range(passes):
        reconcile_pass()
        fleet.beat("a")
        fleet.beat("b")
        advance_rollouts()
        check_canaries()


def start(world: dict[str, Any], percent: int = 20, **options: Any) -> Rollout:
    rollout = canary.start_canary_update(
        actor=world["alice"],
        name=NAME,
        settings_=canary.canary_settings(percent=percent, **options),
    )
    fetches.run_fetch(rollout.fetch_id)
    settle(world["fleet"])
    return rollout


def model() -> Model:
    return Model.objects.get(name=NAME)


def revisions() -> list[str]:
    """Each active replica: on the model's current files, or out of date."""
    current = model()
    keys = current_keys(current)
    return sorted(
        ("current" if r.spec_key == keys[r.profile] else "out of date")
        for r in Replica.objects.filter(model=current, withdrawn_at__isnull=True)
    )


def answers(
    old: tuple[int, int, float], new: tuple[int, int, float], *, at: float | None = None
) -> None:
    """The gateway's figures: (requests, server errors, seconds each) per revision, stamped by
    the gateway's wall clock (`at`, a Unix time, when it stands elsewhere)."""
    state = model().canary or {}
    book = TrafficBook("gw-1")
    for revision, (requests, errors, seconds) in (
        (state["from_revision"], old),
        (state["revision"], new),
    ):
        for index in range(requests):
            book.record(
                model=NAME,
                key_id=None,
                status=500 if index < errors else 200,
                seconds=seconds,
                revision=revision,
                at=at,
            )
    book.flush()


def test_the_canary_replica_serves_beside_the_old_ones_once_ready(world: dict[str, Any]) -> None:
    rollout = start(world)
    state = model().canary
    assert state["state"] == "watching" and state["percent"] == 20
    # A surge replica on the new files; both old ones still serve.
    assert revisions() == ["current", "out of date", "out of date"]
    new = [
        r
        for r in Replica.objects.filter(model=model(), withdrawn_at__isnull=True)
        if replica_revision(r.spec) == state["revision"]
    ]
    assert len(new) == 1 and new[0].routable
    rollout.refresh_from_db()
    assert rollout.state == Rollout.ROLLING and rollout.step.startswith(
        "canary: 20% of the requests to"
    )
    assert model().canary_in_force is not None


def test_errors_on_the_new_revision_roll_it_back_and_the_audit_holds_the_figures(
    world: dict[str, Any],
) -> None:
    old_replicas = set(
        Replica.objects.filter(withdrawn_at__isnull=True).values_list("pk", flat=True)
    )
    rollout = start(world)
    old_source = model().previous["source"]
    answers(old=(40, 0, 0.2), new=(12, 6, 0.05))
    check_canaries()
    current = model()
    assert current.canary["state"] == "rolled back"
    assert current.source == old_source
    assert current.previous is None  # as before the update: it was never updated
    assert current.update_available is not None  # the update is still there to try again
    rollout.refresh_from_db()
    assert rollout.state == Rollout.FAILED
    assert rollout.message.startswith(
        "canary rolled back: unhealthy: server errors on the new revision: 6 of 12"
    )
    settle(world["fleet"])
    # The old files are current again: the canary replica left, both old replicas stayed.
    assert revisions() == ["current", "current"]
    assert (
        set(Replica.objects.filter(withdrawn_at__isnull=True).values_list("pk", flat=True))
        == old_replicas
    )
    entry = AuditEntry.objects.filter(model_name=NAME, action="canary-rollback").get()
    assert entry.actor_name == "system"
    assert entry.before["figures"]["old"] == {
        "requests": 40,
        "errors": 0,
        "seconds": pytest.approx(8.0),
    }
    assert entry.before["figures"]["new"] == {
        "requests": 12,
        "errors": 6,
        "seconds": pytest.approx(0.6),
    }
    assert "old revision: 40 requests, 0 server errors, mean latency 0.200 s" in entry.note
    assert "new revision: 12 requests, 6 server errors" in entry.note


def test_answers_from_before_the_window_decide_nothing(world: dict[str, Any]) -> None:
    rollout = canary.start_canary_update(
        actor=world["alice"], name=NAME, settings_=canary.canary_settings(percent=20)
    )
    fetches.run_fetch(rollout.fetch_id)
    # Failures counted before the window starts (its replica serving before the control plane
    # saw it ready, or a canary of the same revision a moment before) are its baseline.
    answers(old=(40, 0, 0.2), new=(12, 12, 0.05))
    settle(world["fleet"])
    state = model().canary
    assert state["state"] == "watching"
    assert state["baseline"][state["revision"]] == {
        "requests": 12,
        "errors": 12,
        "seconds": pytest.approx(0.6),
    }
    assert state["figures"]["new"] == {"requests": 0, "errors": 0, "seconds": 0.0}


def test_too_few_requests_decide_nothing(world: dict[str, Any]) -> None:
    start(world)
    answers(old=(40, 0, 0.2), new=(9, 9, 0.05))
    check_canaries()
    state = model().canary
    assert state["state"] == "watching" and state["checks"] >= 1
    assert state["figures"]["new"]["requests"] == 9
    assert "answered 9 of the 10 requests" in state["verdict"]


def test_a_much_slower_new_revision_is_rolled_back(world: dict[str, Any]) -> None:
    start(world)
    answers(old=(40, 0, 0.2), new=(20, 0, 1.0))
    check_canaries()
    assert model().canary["state"] == "rolled back"
    assert "5.0 times slower" in model().canary["decision"]


def test_healthy_at_the_end_of_the_window_it_is_promoted_and_the_rollout_completes(
    world: dict[str, Any],
) -> None:
    rollout = start(world, window="10m")
    answers(old=(40, 0, 0.2), new=(20, 0, 0.25))
    check_canaries()
    assert model().canary["state"] == "watching"  # healthy, but the window runs on
    state = model().canary
    Model.objects.filter(name=NAME).update(
        canary={**state, "ends_at": (timezone.now() - timedelta(seconds=1)).isoformat()}
    )
    check_canaries()
    assert model().canary["state"] == "promoted"
    settle(world["fleet"], passes=20)
    rollout.refresh_from_db()
    assert rollout.state == Rollout.DONE
    assert revisions() == ["current", "current"]
    entry = AuditEntry.objects.get(model_name=NAME, action="canary-promote")
    assert entry.actor_name == "system" and entry.note.startswith("canary of ")


def test_answers_a_gateway_stamps_after_its_clock_stepped_back_are_counted(
    world: dict[str, Any],
) -> None:
    start(world)
    started = datetime.fromisoformat(model().canary["started_at"])
    # The gateway's clock stepped back five minutes since the window opened: the minutes it
    # stamps now fall before the window's start.
    answers(old=(40, 0, 0.2), new=(20, 20, 0.05), at=(started - timedelta(minutes=5)).timestamp())
    check_canaries()
    assert model().canary["state"] == "rolled back"
    assert model().canary["figures"]["new"]["requests"] == 20


class _FiveMinutesBehind(datetime):
    """A worker's wall clock stepped five minutes back."""

    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return datetime.now(tz) - timedelta(minutes=5)


def test_the_window_ends_by_the_databases_clock_whatever_the_workers_says(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    start(world, window="10m")
    answers(old=(40, 0, 0.2), new=(20, 0, 0.25))
    state = model().canary
    Model.objects.filter(name=NAME).update(
        canary={**state, "ends_at": (database_now() - timedelta(seconds=1)).isoformat()}
    )
    monkeypatch.setattr(canary_check, "datetime", _FiveMinutesBehind)
    check_canaries()
    assert model().canary["state"] == "promoted"


def test_a_canary_replica_that_cannot_start_is_rolled_back(world: dict[str, Any]) -> None:
    from fleet.reconciler import MAX_START_FAILURES

    rollout = canary.start_canary_update(
        actor=world["alice"], name=NAME, settings_=canary.canary_settings(percent=20)
    )
    fetches.run_fetch(rollout.fetch_id)
    advance_rollouts()
    fleet = world["fleet"]
    old = {str(r.pk) for r in Replica.objects.filter(model=model())}
    for _ in range(MAX_START_FAILURES + 1):
        reconcile_pass()
        for node in ("a", "b"):
            fleet.beat(
                node,
                states={
                    str(r.pk): ("ready" if str(r.pk) in old else "failed")
                    for r in Replica.objects.filter(node__name=node, withdrawn_at__isnull=True)
                },
            )
    check_canaries()
    state = model().canary
    assert state["state"] == "rolled back"
    assert state["decision"].startswith("the canary replica could not start: halted")
    rollout.refresh_from_db()
    assert rollout.state == Rollout.FAILED


def test_promote_and_abort_by_hand_are_the_owners_or_staffs_and_audited(
    world: dict[str, Any],
) -> None:
    users = world["users"]
    start(world)
    for outsider in ("bob",):
        with pytest.raises(Refused) as refused:
            canary.abort_canary(actor=Actor.for_user(users[outsider], "api"), name=NAME)
        assert refused.value.status == 403
        with pytest.raises(Refused):
            canary.promote_canary(actor=Actor.for_user(users[outsider], "api"), name=NAME)
    assert model().canary["state"] == "watching"  # refused: nothing changed

    canary.abort_canary(actor=Actor.for_user(users["staff"], "console"), name=NAME)
    state = model().canary
    assert (state["state"], state["decided_by"]) == ("aborted", "staff")
    entry = AuditEntry.objects.get(model_name=NAME, action="canary-rollback")
    assert (entry.actor_name, entry.door) == ("staff", "console")

    with pytest.raises(Refused) as refused:
        canary.promote_canary(actor=world["alice"], name=NAME)
    assert refused.value.status == 409
    assert refused.value.message == (
        "tiny-chat-q4 has no canary under way (the last one was aborted). Start one with "
        "`llmgw ctl model update tiny-chat-q4 --canary PERCENT`."
    )

    check_updates()
    start(world)
    canary.promote_canary(actor=world["alice"], name=NAME)
    assert model().canary["state"] == "promoted"
    entry = AuditEntry.objects.get(model_name=NAME, action="canary-promote")
    assert (entry.actor_name, entry.door) == ("alice", "cli")
    settle(world["fleet"], passes=20)
    assert revisions() == ["current", "current"]


def test_a_rollback_during_a_canary_is_refused_and_points_at_abort(world: dict[str, Any]) -> None:
    start(world)
    before = (model().source, model().previous, model().canary)
    with pytest.raises(Refused) as refused:
        start_rollback(actor=world["alice"], name=NAME)
    assert refused.value.status == 409
    assert "`llmgw ctl model canary abort tiny-chat-q4`" in refused.value.message
    assert (model().source, model().previous, model().canary) == before
    assert not Rollout.objects.filter(kind="rollback").exists()


# -- the API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"canary": 0}, "canary: must be a whole percentage from 1 to 99"),
        ({"canary": 100}, "canary: must be a whole percentage from 1 to 99"),
        ({"canary": "10"}, "canary"),
        ({"canary": 10.5}, "canary"),
        ({"canary": True}, "canary"),
        ({"canary": 10, "for": "forever"}, "--for: 'forever' is not a duration"),
        ({"canary": 10, "for": "2s"}, "--for must be between 10s and 1d (got '2s')"),
        ({"canary": 10, "max_error_rate": 1}, "--max-error-rate must be a fraction from 0 up to"),
        ({"canary": 10, "max_error_rate": 2}, "max_error_rate: must be a fraction from 0 up to"),
        ({"canary": 10, "max_error_rate": -1}, "max_error_rate"),
        ({"canary": 10, "max_latency_ratio": 0.5}, "max_latency_ratio"),
        ({"canary": 10, "percent": 5}, "unknown field"),
        ({"for": "10m"}, "--for only mean something for a canary update; add --canary PERCENT"),
        (
            {"max_error_rate": 0.1, "max_latency_ratio": 3},
            "--max-error-rate, --max-latency-ratio only",
        ),
        ([1, 2], "Expected a dictionary"),
    ],
)
def test_the_update_endpoint_refuses_bad_canary_settings_and_changes_nothing(
    world: dict[str, Any], api: Any, body: Any, says: str
) -> None:
    before = model()
    answer = api("alice").post(f"/api/v1/models/{NAME}/update", body, format="json")
    assert answer.status_code == 400, answer.content
    assert says in answer.json()["detail"] or says in str(answer.json().get("problems")), (
        answer.json()
    )
    after = model()
    assert (after.source, after.canary, after.update_available) == (
        before.source,
        None,
        before.update_available,
    )
    assert not Rollout.objects.exists()


def test_the_api_starts_follows_and_promotes_a_canary(world: dict[str, Any], api: Any) -> None:
    answer = api("alice").post(
        f"/api/v1/models/{NAME}/update",
        {"canary": 25, "for": "2m", "max_error_rate": 0.1, "max_latency_ratio": 3},
        format="json",
    )
    assert answer.status_code == 202, answer.content
    assert answer.json()["kind"] == "update"
    shown = api("bob").get(f"/api/v1/models/{NAME}/canary").json()
    assert (shown["state"], shown["percent"], shown["window"]) == ("waiting", 25, "2m")
    assert (shown["max_error_rate"], shown["max_latency_ratio"], shown["asked_by"]) == (
        0.1,
        3.0,
        "alice",
    )
    fetches.run_fetch(Rollout.objects.get().fetch_id)
    settle(world["fleet"])
    answers(old=(30, 0, 0.2), new=(5, 0, 0.2))
    check_canaries()
    listed = api("bob").get("/api/v1/canaries").json()["canaries"]
    assert [(c["model"], c["state"], c["active"]) for c in listed] == [(NAME, "watching", True)]
    assert listed[0]["old"] == {
        "requests": 30,
        "server_errors": 0,
        "error_rate": 0.0,
        "mean_latency": pytest.approx(0.2),
    }
    assert listed[0]["new"]["requests"] == 5

    refused = api("bob").post(f"/api/v1/models/{NAME}/canary/promote")
    assert refused.status_code == 403 and "belongs to alice" in refused.json()["detail"]
    promoted = api("staff").post(f"/api/v1/models/{NAME}/canary/promote")
    assert promoted.status_code == 200
    assert (promoted.json()["state"], promoted.json()["decided_by"]) == ("promoted", "staff")
    again = api("alice").post(f"/api/v1/models/{NAME}/canary/abort")
    assert again.status_code == 409 and again.json()["code"] == "no_canary"


def test_a_model_without_a_canary_says_how_to_start_one(world: dict[str, Any], api: Any) -> None:
    answer = api("alice").get(f"/api/v1/models/{NAME}/canary")
    assert answer.status_code == 404
    assert answer.json()["detail"] == (
        "tiny-chat-q4 has never had a canary update. Start one with `llmgw ctl model update "
        "tiny-chat-q4 --canary PERCENT`."
    )
    assert api("alice").post("/api/v1/models/nope/canary/abort").status_code == 404


# -- no key can swing another owner's canary ------------------------------------------------


def key_of(world: dict[str, Any], user: str) -> int:
    from access.models import GatewayKey
    from access.services import key_create

    key_create(actor=Actor.for_user(world["users"][user], "api"), name=f"{user}'s app")
    return int(GatewayKey.objects.filter(owner=world["users"][user]).latest("pk").pk)


def answers_by_key(sent: dict[int, tuple[tuple[int, int], tuple[int, int]]]) -> None:
    """The gateway's figures as its traffic book writes them while the canary runs:
    per key, ((requests, server errors) on the old revision, the same on the new)."""
    state = model().canary or {}
    book = TrafficBook("gw-1")
    for key_id, sides in sent.items():
        for revision, (requests, errors) in zip(
            (state["from_revision"], state["revision"]), sides, strict=True
        ):
            for index in range(requests):
                book.record(
                    model=NAME,
                    key_id=key_id,
                    status=500 if index < errors else 200,
                    seconds=0.2,
                    revision=revision,
                    canary=True,
                )
    book.flush()


def test_one_key_failing_on_both_revisions_does_not_roll_back_another_owners_canary(
    world: dict[str, Any],
) -> None:
    start(world)
    healthy = {key_of(world, user): ((40, 0), (10, 0)) for user in ("alice", "carol", "staff")}
    # bob owns nothing here: 187 requests the engine fails on, whichever revision answers.
    bob = key_of(world, "bob")
    answers_by_key({**healthy, bob: ((149, 149), (38, 38))})
    check_canaries()
    state = model().canary
    assert state["state"] == "watching", state.get("decision")
    assert state["figures"]["new"] == {"requests": 68, "errors": 38, "seconds": pytest.approx(13.6)}
    assert state["figures"]["keys"] == {"sending": 4, "with_excess": 0, "excess_errors": 0}
    assert (
        "0 of them beyond what each key saw on the old revision (0 of 4 keys)" in (state["verdict"])
    )
    view = canary.canary_view(model())
    assert view is not None and view["keys"]["sending"] == 4
    assert view["new"]["server_errors"] == 38  # the shape shown before, unchanged


def test_a_new_revision_failing_for_several_keys_is_still_rolled_back(
    world: dict[str, Any],
) -> None:
    start(world)
    keys = {key_of(world, user): ((40, 0), (10, 4)) for user in ("alice", "carol", "bob")}
    answers_by_key(keys)
    check_canaries()
    current = model()
    assert current.canary["state"] == "rolled back"
    assert current.canary["decision"].startswith(
        "unhealthy: server errors on the new revision beyond what each key saw on the old one: "
        "12 of 30 (40.0%), from 3 of 3 keys"
    )
    entry = AuditEntry.objects.filter(model_name=NAME, action="canary-rollback").get()
    assert entry.before["figures"]["keys"] == {"sending": 3, "with_excess": 3, "excess_errors": 12}
    assert "12 server errors beyond what each key saw on the old revision, from 3 of 3 keys" in (
        entry.note
    )


def test_a_new_revision_failing_for_its_only_client_is_still_rolled_back(
    world: dict[str, Any],
) -> None:
    start(world)
    answers_by_key({key_of(world, "bob"): ((149, 0), (38, 38))})
    check_canaries()
    assert model().canary["state"] == "rolled back"

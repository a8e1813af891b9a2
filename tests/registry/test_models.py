"""The registry's rows change themselves: the stale-fetch rule asked in Python (Fetch methods)
and in SQL (FetchQuerySet) must say the same of every fetch, and each transition changes a row
only from the states it is for."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from catalog.models import Model
from core.dbclock import database_now
from registry.models import LEASE_SECONDS, Fetch, Rollout

pytestmark = pytest.mark.django_db

# Heartbeats around the stale limit, in seconds before now (None: never written).
HEARTBEATS = [None, 0, 1, LEASE_SECONDS - 1, LEASE_SECONDS, LEASE_SECONDS + 1, 3600]


def test_it_asks_the_stale_rule_alike_in_python_and_sql() -> None:
    now = timezone.now()
    for state in (Fetch.QUEUED, Fetch.RUNNING, Fetch.DONE, Fetch.FAILED):
        for ago in HEARTBEATS:
            Fetch.objects.create(
                repo=f"{state}/{ago}",
                commit="c" * 40,
                state=state,
                heartbeat_at=None if ago is None else now - timedelta(seconds=ago),
            )
    orphaned = set(Fetch.objects.orphaned(now).values_list("pk", flat=True))
    claimable = set(Fetch.objects.claimable(now).values_list("pk", flat=True))
    for fetch in Fetch.objects.all():
        assert (fetch.pk in orphaned) == fetch.is_orphaned(now), fetch.repo
        assert (fetch.pk in claimable) == fetch.is_claimable(now), fetch.repo
    # Both answers occur, so neither side can pass by saying no (or yes) to everything.
    assert orphaned and claimable - orphaned
    assert set(Fetch.objects.values_list("pk", flat=True)) - claimable
    assert Fetch.objects.get(repo=f"running/{LEASE_SECONDS + 1}").pk in orphaned
    assert Fetch.objects.get(repo=f"running/{LEASE_SECONDS - 1}").pk not in orphaned


def test_it_lets_one_worker_claim_a_fetch_and_another_take_over_an_orphaned_one() -> None:
    fetch = Fetch.objects.create(repo="r", commit="c" * 40)
    assert Fetch.claim(fetch.pk)
    assert not Fetch.claim(fetch.pk)  # the first worker holds it
    later = timezone.now() + timedelta(seconds=LEASE_SECONDS + 1)
    assert Fetch.claim(fetch.pk, now=later)  # its worker is gone
    fetch.refresh_from_db()
    assert (fetch.state, fetch.heartbeat_at) == (Fetch.RUNNING, later)
    fetch.finish()
    assert not Fetch.claim(fetch.pk, now=later + timedelta(hours=1))


def test_its_lease_is_kept_by_the_databases_clock_not_a_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fetch = Fetch.objects.create(repo="r", commit="c" * 40)
    assert Fetch.claim(fetch.pk, holder="worker-1")
    # Another worker whose wall clock stepped five minutes forward: by it the lease lapsed long
    # ago, by the database's (which stamped the heartbeat) it did not.
    ahead = timezone.now() + timedelta(minutes=5)
    monkeypatch.setattr(timezone, "now", lambda: ahead)
    assert fetch.pk in set(Fetch.objects.orphaned(ahead).values_list("pk", flat=True))
    assert not Fetch.objects.orphaned().filter(pk=fetch.pk).exists()
    assert not Fetch.claim(fetch.pk, holder="worker-2")
    # Once the database's clock says its heartbeat is LEASE_SECONDS old, another takes it over.
    Fetch.objects.filter(pk=fetch.pk).update(
        heartbeat_at=database_now() - timedelta(seconds=LEASE_SECONDS + 1)
    )
    assert Fetch.claim(fetch.pk, holder="worker-2")
    fetch.refresh_from_db()
    assert fetch.holder == "worker-2"
    assert abs((fetch.heartbeat_at - database_now()).total_seconds()) < 5


def test_it_finishes_and_fails_a_fetch() -> None:
    fetch = Fetch.objects.create(repo="r", commit="c" * 40, bytes_total=10, state=Fetch.RUNNING)
    fetch.beat(4, message="fetching a.gguf")
    fetch.refresh_from_db()
    assert (fetch.bytes_done, fetch.message) == (4, "fetching a.gguf")
    fetch.finish()
    fetch.refresh_from_db()
    assert (fetch.state, fetch.bytes_done, fetch.message) == (Fetch.DONE, 10, "")
    finished_at = fetch.finished_at
    assert finished_at is not None
    # The files are in but the model is refused: failed, and it keeps when it finished.
    fetch.refuse_model("the model was not added")
    fetch.refresh_from_db()
    assert (fetch.state, fetch.message, fetch.finished_at) == (
        Fetch.FAILED,
        "the model was not added",
        finished_at,
    )


@pytest.fixture
def model() -> Model:
    return Model.objects.create(name="m", source="http://127.0.0.1:9/m.gguf")


def test_it_moves_a_rollout_only_while_it_is_under_way(model: Model) -> None:
    rollout = Rollout.objects.create(model=model, kind="update", state=Rollout.FETCHING)
    assert Rollout.objects.active().get() == rollout
    assert rollout.show_step("fetching", states=(Rollout.ROLLING,)) is False
    assert rollout.start_rolling()
    assert not rollout.start_rolling()  # another worker took this step
    assert rollout.show_progress(replaced=1, total=2, step="replaced 1 of 2")
    assert rollout.finish("every replica runs it")
    assert not rollout.fail("too late")
    assert not rollout.show_step("replaced 2 of 2")  # never over how it ended
    rollout.refresh_from_db()
    assert (rollout.state, rollout.message, rollout.step) == (
        Rollout.DONE,
        "every replica runs it",
        "every replica runs it",
    )
    assert (rollout.replaced, rollout.total) == (1, 2)
    assert rollout.finished_at is not None
    assert not Rollout.objects.active().exists()


def test_it_halts_fails_and_stops_a_rollout(model: Model) -> None:
    halted = Rollout.objects.create(model=model, kind="update", state=Rollout.ROLLING)
    assert halted.halt("the new replica keeps failing")
    failed = Rollout.objects.create(model=model, kind="update", state=Rollout.FETCHING)
    assert failed.fail("refused")
    stopped = Rollout.objects.create(
        model=model, kind="update", state=Rollout.FETCHING, step="fetching: 1 of 2 MB"
    )
    assert stopped.stop("stopped by a rollback asked for by alice")
    states = dict(Rollout.objects.values_list("pk", "state"))
    assert states == {
        halted.pk: Rollout.HALTED,
        failed.pk: Rollout.FAILED,
        stopped.pk: Rollout.FAILED,
    }
    stopped.refresh_from_db()
    # A stopped rollout shows how far it got; its message says why it ended.
    assert stopped.step == "fetching: 1 of 2 MB"
    assert stopped.message == "stopped by a rollback asked for by alice"
    assert stopped.finished_at is not None

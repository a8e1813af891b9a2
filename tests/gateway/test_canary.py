"""The gateway's side of a canary update: the share of requests the new revision gets, and the
figures it keeps per revision."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from catalog.models import CanaryRouting, canary_routing
from gateway.canary import revision_figures, share
from gateway.routing import Candidate, Serve, read_catalog, read_replicas
from gateway.traffic import TrafficBook
from tests.gateway.test_routing import entry

pytestmark = pytest.mark.smoke

NOW = datetime(2026, 12, 2, 12, 30, 20, tzinfo=UTC)


def replica(id: str, revision: str, state: str = "ready") -> Candidate:
    return Candidate(
        id=id, model="chat", state=state, address="127.0.0.1", port=1, revision=revision
    )


OLD_A, OLD_B, NEW = replica("a", "old"), replica("b", "old"), replica("c", "new")
SERVE = Serve(model="chat", engine_name="chat", candidates=(OLD_A, OLD_B, NEW))
CANARY = entry("chat", canary=CanaryRouting(revision="new", percent=10))


def test_a_draw_below_the_percent_goes_to_the_new_revision() -> None:
    assert share(SERVE, CANARY, 0.0).candidates == (NEW,)
    assert share(SERVE, CANARY, 0.0999).candidates == (NEW,)


def test_a_draw_at_or_above_the_percent_goes_to_the_old_revision() -> None:
    assert share(SERVE, CANARY, 0.1).candidates == (OLD_A, OLD_B)
    assert share(SERVE, CANARY, 0.99).candidates == (OLD_A, OLD_B)


def test_without_a_canary_every_ready_replica_is_a_candidate() -> None:
    assert share(SERVE, entry("chat"), 0.0) == SERVE


def test_when_one_side_has_no_ready_replica_the_other_takes_everything() -> None:
    only_old = replace(SERVE, candidates=(OLD_A, OLD_B))
    assert share(only_old, CANARY, 0.0) == only_old
    only_new = replace(SERVE, candidates=(NEW,))
    assert share(only_new, CANARY, 0.99) == only_new


def test_a_fallbacks_answer_is_not_split() -> None:
    fallback = replace(SERVE, fallback_from="other")
    assert share(fallback, CANARY, 0.0) == fallback


def test_the_share_comes_out_near_the_percent_over_many_draws() -> None:
    import random

    draws = random.Random(7)
    to_new = sum(share(SERVE, CANARY, draws.random()).candidates == (NEW,) for _ in range(10_000))
    assert 800 < to_new < 1200


def test_only_a_canary_under_way_is_routed_by() -> None:
    running = {"state": "watching", "revision": "new", "percent": 25}
    assert canary_routing(running) == CanaryRouting(revision="new", percent=25)
    assert canary_routing({**running, "state": "waiting"}) is not None
    for ended in ("promoted", "rolled back", "aborted"):
        assert canary_routing({**running, "state": ended}) is None
    assert canary_routing(None) is None
    assert canary_routing({"state": "watching", "revision": 5, "percent": 25}) is None


def test_the_catalog_and_replicas_carry_the_canary_and_each_replicas_revision(
    catalog: Any,
) -> None:
    from catalog.models import Model
    from fleet.specs import weights_revision

    catalog.add("chat")
    old = catalog.replica("chat", 9001)
    new = catalog.replica("chat", 9002)
    new.spec = {**new.spec, "source": "http://x/new.gguf", "sha256": "ab" * 32}
    new.save()
    Model.objects.filter(name="chat").update(
        canary={"state": "watching", "revision": "abab", "percent": 5}
    )
    assert read_catalog().entries["chat"].canary == CanaryRouting(revision="abab", percent=5)
    revisions = {c.id: c.revision for c in read_replicas()["chat"]}
    assert revisions[str(new.pk)] == weights_revision("http://x/new.gguf", "ab" * 32) == "ab" * 6
    assert revisions[str(old.pk)] == weights_revision("", None) != revisions[str(new.pk)]


@pytest.mark.django_db
def test_figures_are_kept_and_read_per_revision() -> None:
    book = TrafficBook("w1")
    for _ in range(3):
        book.record(
            model="chat", key_id=None, status=200, seconds=0.2, at=NOW.timestamp(), revision="old"
        )
    book.record(
        model="chat", key_id=None, status=500, seconds=0.01, at=NOW.timestamp(), revision="new"
    )
    book.record(
        model="chat", key_id=None, status=200, seconds=0.4, at=NOW.timestamp(), revision="new"
    )
    book.record(
        model="chat", key_id=None, status=503, seconds=0.0, at=NOW.timestamp()
    )  # no replica
    book.record(
        model="other", key_id=None, status=200, seconds=0.1, at=NOW.timestamp(), revision="new"
    )
    earlier = (NOW - timedelta(minutes=3)).timestamp()
    book.record(model="chat", key_id=None, status=200, seconds=0.1, at=earlier, revision="old")
    book.flush(now=NOW.timestamp())

    found = revision_figures(["chat"], NOW - timedelta(seconds=10))
    assert set(found) == {"old", "new"}
    assert (found["old"].requests, found["old"].server_errors) == (3, 0)
    assert (found["new"].requests, found["new"].server_errors) == (2, 1)
    assert found["new"].seconds == pytest.approx(0.41)

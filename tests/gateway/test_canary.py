"""The gateway's side of a canary update: the share of requests the new revision gets, and the
figures it keeps per revision."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from access.canary import revision_figures
from access.traffic import TrafficBook, fold
from catalog.models import CanaryRouting, canary_routing
from gateway.canary import share
from gateway.routing import Candidate, Serve, read_catalog, read_replicas
from registry.canary import (
    CanarySettings,
    KeyFigures,
    RevisionFigures,
    Verdict,
    judge,
    key_figures,
)
from registry.models import CanaryKeyMinute
from tests.gateway.test_routing import entry

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


# -- no key can swing the decision (registry.canary.judge with per-key figures) ----------------

LIMITS = CanarySettings(percent=20, window_seconds=600, max_error_rate=0.05, max_latency_ratio=2.0)


def side(requests: int, errors: int = 0, seconds: float = 0.2) -> RevisionFigures:
    return RevisionFigures(requests=requests, errors=errors, seconds=requests * seconds)


def judged(keys: dict[int, KeyFigures], *, over: bool = False) -> Verdict:
    old, new = RevisionFigures(), RevisionFigures()
    for seen in keys.values():
        old = RevisionFigures(
            old.requests + seen.old.requests,
            old.errors + seen.old.errors,
            old.seconds + seen.old.seconds,
        )
        new = RevisionFigures(
            new.requests + seen.new.requests,
            new.errors + seen.new.errors,
            new.seconds + seen.new.seconds,
        )
    return judge(old, new, LIMITS, min_requests=20, window_over=over, keys=keys)


# Three keys whose requests both revisions answer well, 20% of them on the new revision.
HEALTHY = {key: KeyFigures(old=side(40), new=side(10)) for key in (1, 2, 3)}
# The attack: one key that does not own the model sends 187 requests the engine fails on,
# whichever revision answers them (149 land on the old revision, 38 on the new).
ATTACKER = 9
FAILS_ON_BOTH = KeyFigures(old=side(149, 149), new=side(38, 38))


def test_one_key_failing_alike_on_both_revisions_is_no_evidence_against_the_canary() -> None:
    keys = {**HEALTHY, ATTACKER: FAILS_ON_BOTH}
    # Without keys, the same figures roll the canary back: 38 errors in 68 answers (55.9%)
    # against 149 in 269 (55.4%). Which side is ahead is the luck of the split at each check.
    old = RevisionFigures(269, 149, 269 * 0.2)
    new = RevisionFigures(68, 38, 68 * 0.2)
    assert judge(old, new, LIMITS, min_requests=20, window_over=False).outcome == "unhealthy"

    found = judged(keys, over=True)
    assert found.outcome == "healthy"
    assert found.excess is not None
    assert found.excess.summary() == {"sending": 4, "with_excess": 0, "excess_errors": 0}
    assert "0 of them beyond what each key saw on the old revision (0 of 4 keys)" in found.reason


def test_a_key_failing_half_the_time_on_both_does_not_win_by_the_luck_of_the_split() -> None:
    # 50% on both; the new side drew 25 failures of 37 where 18.5 were expected.
    keys = {**HEALTHY, ATTACKER: KeyFigures(old=side(150, 75), new=side(37, 25))}
    assert judged(keys).outcome == "undecided"


def test_errors_only_on_the_new_revision_from_several_keys_are_unhealthy() -> None:
    keys = {key: KeyFigures(old=side(40), new=side(10, 3)) for key in (1, 2, 3)}
    found = judged(keys)
    assert found.outcome == "unhealthy"
    assert found.reason.startswith(
        "server errors on the new revision beyond what each key saw on the old one: 9 of 30 "
        "(30.0%), from 3 of 3 keys, above the limit of 5.0%"
    )


def test_errors_only_on_the_new_revision_from_the_only_key_are_unhealthy() -> None:
    assert judged({ATTACKER: KeyFigures(old=side(150), new=side(37, 37))}).outcome == "unhealthy"


def test_errors_on_the_new_revision_for_one_keys_requests_only_are_unhealthy() -> None:
    # That key's own old-revision figures show the difference: the revision, not the request.
    keys = {**HEALTHY, ATTACKER: KeyFigures(old=side(150), new=side(37, 37))}
    assert judged(keys).outcome == "unhealthy"


def test_without_an_old_revision_one_key_alone_decides_nothing_while_others_send() -> None:
    # The canary took the place of the model's only replica: the old revision answers nothing.
    keys = {key: KeyFigures(old=side(0), new=side(30)) for key in (1, 2, 3)}
    keys[ATTACKER] = KeyFigures(old=side(0), new=side(187, 187))
    assert judged(keys).outcome == "undecided"
    # The same failures from two keys, or from the only key sending, decide.
    keys[1] = KeyFigures(old=side(0), new=side(30, 30))
    assert judged(keys).outcome == "unhealthy"
    assert judged({ATTACKER: keys[ATTACKER]}).outcome == "unhealthy"


def test_one_keys_slow_requests_weigh_alike_on_both_revisions() -> None:
    # The split sent more of one key's slow requests to the new revision this time.
    keys = {
        1: KeyFigures(old=side(200, seconds=0.1), new=side(20, seconds=0.1)),
        ATTACKER: KeyFigures(old=side(10, seconds=5.0), new=side(30, seconds=5.0)),
    }
    old = RevisionFigures(210, 0, 200 * 0.1 + 10 * 5.0)
    new = RevisionFigures(50, 0, 20 * 0.1 + 30 * 5.0)
    assert judge(old, new, LIMITS, min_requests=20, window_over=False).outcome == "unhealthy"
    assert judged(keys).outcome == "undecided"
    # A new revision slower for every key is still too slow.
    slower = {key: KeyFigures(old=seen.old, new=side(seen.new.requests, seconds=seen.new.mean_latency * 3)) for key, seen in keys.items()}  # type: ignore[operator]  # fmt: skip
    assert judged(slower).outcome == "unhealthy"


@pytest.mark.django_db
def test_the_book_keeps_figures_per_key_only_for_a_model_under_a_canary() -> None:
    book = TrafficBook("w1")
    at = NOW.timestamp()
    for status in (200, 500, 500):
        book.record(model="chat", key_id=7, status=status, seconds=0.5, at=at, revision="new", canary=True)  # fmt: skip
    book.record(model="chat", key_id=7, status=200, seconds=0.25, at=at, revision="old", canary=True)  # fmt: skip
    book.record(model="chat", key_id=8, status=500, seconds=0.1, at=at, revision="old", canary=True)  # fmt: skip
    # No canary, no key or no replica: nothing per key.
    book.record(model="plain", key_id=7, status=500, seconds=0.1, at=at, revision="old")
    book.record(model="chat", key_id=None, status=500, seconds=0.1, at=at, revision="old", canary=True)  # fmt: skip
    book.record(model="chat", key_id=7, status=503, seconds=0.0, at=at, canary=True)
    book.flush(now=at)
    assert CanaryKeyMinute.objects.count() == 3
    book.record(model="chat", key_id=7, status=200, seconds=0.5, at=at, revision="new", canary=True)  # fmt: skip
    book.flush(now=at)  # totals again, not increments
    assert CanaryKeyMinute.objects.count() == 3

    found = key_figures(["chat"], ["old", "new"], NOW - timedelta(seconds=10))
    assert found == {
        7: {
            "new": RevisionFigures(requests=4, errors=2, seconds=pytest.approx(2.0)),
            "old": RevisionFigures(requests=1, errors=0, seconds=0.25),
        },
        8: {"old": RevisionFigures(requests=1, errors=1, seconds=pytest.approx(0.1))},
    }
    # Over: the book forgets them, and fold deletes them a day later.
    book.flush(now=at + 3 * 60)
    assert book._canary_keys == {}
    fold(now=NOW + timedelta(days=1, minutes=5))
    assert CanaryKeyMinute.objects.count() == 0

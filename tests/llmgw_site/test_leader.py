"""The beat lease and the claim of each periodic send (llmgw_site.leader), on the test database.

Expiry is decided by the database's clock, so the tests that need a lease to run out take one
a second long and wait until the database calls it expired (`_expired`)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from llmgw_site import leader
from llmgw_site.models import Lease, PeriodicRun
from tests.support.waiting import stays, wait_for

pytestmark = pytest.mark.django_db


def _expired() -> None:
    """Waits until the database's clock says the (one second) lease ran out."""
    wait_for(
        lambda: not leader.holder_of().live,  # type: ignore[union-attr]
        timeout=3,
        what="the 1 s lease to expire by the database's clock",
    )


def test_it_takes_a_free_lease() -> None:
    held = leader.take(holder="a", seconds=30)
    assert held is not None
    assert (held.holder, held.term, held.previous) == ("a", 1, None)
    current = leader.holder_of()
    assert current is not None
    assert (current.holder, current.term, current.live) == ("a", 1, True)


def test_its_holder_renews_it_and_keeps_the_term() -> None:
    first = leader.take(holder="a", seconds=30)
    renewed = leader.take(holder="a", seconds=30)
    assert first is not None and renewed is not None
    assert renewed.term == first.term == 1
    assert renewed.expires_at >= first.expires_at


def test_another_cannot_take_a_live_lease() -> None:
    leader.take(holder="a", seconds=30)
    assert leader.take(holder="b", seconds=30) is None
    assert Lease.objects.get(name=leader.BEAT).holder == "a"


def test_another_takes_it_only_after_it_expires() -> None:
    leader.take(holder="a", seconds=1)
    assert leader.take(holder="b", seconds=30) is None
    _expired()
    taken = leader.take(holder="b", seconds=30)
    assert taken is not None
    assert (taken.holder, taken.term, taken.previous) == ("b", 2, "a")
    # The old holder's renewal now fails: it learns it lost the lease.
    assert leader.take(holder="a", seconds=30) is None


def test_a_holder_renews_after_its_expiry_if_nobody_took_it() -> None:
    leader.take(holder="a", seconds=1)
    _expired()
    renewed = leader.take(holder="a", seconds=30)
    assert renewed is not None and renewed.term == 1 and renewed.previous is None


def test_releasing_lets_another_take_it_at_once() -> None:
    leader.take(holder="a", seconds=30)
    assert leader.release(holder="b") is False  # not b's to release
    assert leader.release(holder="a") is True
    taken = leader.take(holder="b", seconds=30)
    assert taken is not None and taken.term == 2


@pytest.mark.django_db(transaction=True)
def test_of_many_taking_at_once_exactly_one_gets_it() -> None:
    if connection.vendor == "sqlite":
        pytest.skip("one writer at a time on SQLite; the shared case is PostgreSQL")
    results: dict[str, object] = {}
    start = threading.Barrier(8)

    def contend(name: str) -> None:
        start.wait()
        try:
            results[name] = leader.take(holder=name, seconds=30)
        finally:
            connection.close()

    threads = [threading.Thread(target=contend, args=(f"h{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [name for name, held in results.items() if held is not None]
    assert len(winners) == 1
    assert Lease.objects.get(name=leader.BEAT).holder == winners[0]


# -- sends ------------------------------------------------------------------------------------


def _claim(holder: str, term: int, interval: float = 30) -> int | None:
    send = leader.claim_send(
        name="probe", task="t.probe", interval=interval, holder=holder, term=term
    )
    if send is not None:
        assert PeriodicRun.objects.get(name="probe").sent_at == send.sent_at
    return None if send is None else send.number


def test_only_the_holder_in_its_term_claims_a_send() -> None:
    held = leader.take(holder="a", seconds=30)
    assert held is not None
    assert _claim("b", held.term) is None  # not the holder
    assert _claim("a", held.term + 1) is None  # a term it does not hold
    assert _claim("a", held.term) == 1
    row = PeriodicRun.objects.get(name="probe")
    assert (row.sends, row.sent_by, row.task) == (1, "a", "t.probe")


def test_a_send_follows_the_last_one_by_at_least_its_interval() -> None:
    held = leader.take(holder="a", seconds=30)
    assert held is not None
    assert _claim("a", held.term, interval=2) == 1
    # Time is what is tested: no send before 2 s less the tolerance (1 s), one soon after.
    stays(
        lambda: _claim("a", held.term, interval=2) is None,
        seconds=0.6,
        what="no second send within the interval less its tolerance",
    )
    second = wait_for(
        lambda: _claim("a", held.term, interval=2),
        timeout=1.0,
        what="the second send, 1 s (2 s less the tolerance) after the first",
    )
    assert second == 2


def test_a_holder_whose_lease_ran_out_sends_nothing() -> None:
    held = leader.take(holder="a", seconds=1)
    assert held is not None
    _expired()
    # Nobody took it, but it ran out: a paused beat that wakes up cannot send on it.
    assert _claim("a", held.term) is None
    assert leader.take(holder="b", seconds=30) is not None
    assert _claim("a", held.term) is None


def test_the_next_holder_continues_the_count_and_honours_the_interval() -> None:
    first = leader.take(holder="a", seconds=1)
    assert first is not None
    assert _claim("a", first.term, interval=30) == 1
    _expired()
    second = leader.take(holder="b", seconds=30)
    assert second is not None
    # a sent it a second ago: b may not send it again within the interval.
    assert _claim("b", second.term, interval=30) is None
    assert leader.last_sends(["probe", "other"]).keys() == {"probe"}


def test_a_send_runs_once_and_only_while_it_is_the_latest() -> None:
    held = leader.take(holder="a", seconds=30)
    assert held is not None
    one = _claim("a", held.term, interval=0.1)
    two = wait_for(
        lambda: _claim("a", held.term, interval=0.1), timeout=3, what="the next send due"
    )
    assert (one, two) == (1, 2)
    assert leader.ran_send(name="probe", send=1) is False  # superseded by send 2
    assert leader.ran_send(name="probe", send=2) is True
    assert leader.ran_send(name="probe", send=2) is False  # delivered twice: runs once

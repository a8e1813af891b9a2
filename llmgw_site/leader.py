"""One beat schedule over several control planes: a lease in the database, and a claim per send.

Two machines may each run the run command (web, gateway, worker and beat) on one PostgreSQL
database and one Redis. Every beat process runs, but only the holder of the lease named "beat"
sends periodic tasks; the others stand by and try to take it every few seconds. The holder
renews it every third of its length; when the holder dies its lease runs out, and the first
standby to ask afterwards takes it (llmgw_site.beat.LeaderScheduler drives these calls).

Why a row in the database rather than a Redis key (SET NX PX, or celery-redbeat's lock):
- The fence and the work live in one place. A send claims its task's row with one conditional
  UPDATE that also checks, in the same statement and by the database's clock, that the sender
  still holds the lease in the term it believes. A beat that paused past its lease (a stopped
  VM, a long GC, a slow disk) and wakes up believing it leads sends nothing. A Redis lease
  cannot fence a write the database receives afterwards.
- One clock decides: expiry and the interval between sends are compared with the database's
  now(), so the machines' clocks may disagree.
- The state periodic work depends on is already in the database; a control plane that cannot
  reach it has nothing useful to schedule. Redis holds only short-lived state here and may be
  restarted empty; a lease lost with it would let two beats send at once.
- It costs one small UPDATE per beat process every few seconds.

What is guaranteed, and what is not:
- Two sends of one entry are at least its interval apart (less CLAIM_TOLERANCE), by the
  database's clock, whichever beats sent them: no periodic task is sent twice for one interval.
- A worker runs a send only if it is still the entry's latest one and has not run
  (`ran_send`): a message that waited in the broker past the next send, or that the broker
  delivers again, does nothing.
- A standby that takes over starts from the last sends recorded here, so a task already due
  is sent at once and the others when due: nothing waits longer than one interval after the
  takeover. During the takeover itself (up to the lease's length after the holder's last
  renewal, plus a standby's poll) nothing is sent.
- A send whose message is lost (Redis died holding it, a worker was killed while running it) is
  not sent again: the next send, one interval later, does that work.

With SQLite there is one machine: the stock Celery scheduler runs, with no lease (`shared`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import (
    BooleanField,
    Case,
    DateTimeField,
    Exists,
    ExpressionWrapper,
    F,
    Q,
    Value,
    When,
)
from django.db.models.functions import Now

from .models import Lease, PeriodicRun

BEAT = "beat"
# How much earlier than its interval a send may follow the last one: room for the delay
# between a beat's clock deciding a task is due and the database stamping the send.
CLAIM_TOLERANCE = 1.0


def shared() -> bool:
    """Whether several control planes may share this database (any but SQLite)."""
    return connection.vendor != "sqlite"


@dataclass(frozen=True)
class Held:
    """The lease as its holder sees it after taking or renewing it."""

    holder: str
    term: int
    expires_at: datetime  # by the database's clock
    previous: str | None  # who held it before this term, when it was taken from another


@dataclass(frozen=True)
class Holder:
    holder: str
    term: int
    expires_at: datetime
    live: bool  # not expired by the database's clock


def _from_now(seconds: float) -> ExpressionWrapper:
    return ExpressionWrapper(
        Now() + Value(timedelta(seconds=seconds)), output_field=DateTimeField()
    )


def take(*, holder: str, seconds: float, name: str = BEAT) -> Held | None:
    """Renew the lease if `holder` holds it, take it if it is free or expired; None if another
    holds it. Never taken from a live holder: the UPDATE's condition is checked by the database
    against its own clock, so two callers cannot both succeed."""
    before = Lease.objects.filter(name=name).values_list("holder", "term").first()
    mine = Q(holder=holder)
    updated = (
        Lease.objects.filter(name=name)
        .filter(mine | Q(expires_at__lte=Now()))
        .update(
            # A holder renewing keeps its term (even after its expiry, if nobody took it in
            # between); anyone else starts a new one.
            term=Case(When(mine, then=F("term")), default=F("term") + 1),
            acquired_at=Case(When(mine, then=F("acquired_at")), default=Now()),
            holder=holder,
            expires_at=_from_now(seconds),
        )
    )
    if not updated and before is None:
        try:
            with transaction.atomic():
                Lease.objects.create(
                    name=name,
                    holder=holder,
                    term=1,
                    acquired_at=Now(),
                    expires_at=_from_now(seconds),
                )
        except IntegrityError:  # another caller made it first
            return None
    elif not updated:
        return None
    row = Lease.objects.filter(name=name, holder=holder).first()
    if row is None:  # taken by another since: only possible after our lease ran out
        return None
    previous = before[0] if before is not None and before[0] != holder else None
    return Held(holder=holder, term=row.term, expires_at=row.expires_at, previous=previous)


def release(*, holder: str, name: str = BEAT) -> bool:
    """End `holder`'s lease now (a clean stop), so a standby takes it at its next try."""
    return bool(Lease.objects.filter(name=name, holder=holder).update(expires_at=Now()))


def holder_of(name: str = BEAT) -> Holder | None:
    row = (
        Lease.objects.filter(name=name)
        .annotate(live=ExpressionWrapper(Q(expires_at__gt=Now()), output_field=BooleanField()))
        .values_list("holder", "term", "expires_at", "live")
        .first()
    )
    if row is None:
        return None
    return Holder(holder=row[0], term=row[1], expires_at=row[2], live=bool(row[3]))


def last_sends(names: list[str]) -> dict[str, datetime]:
    """When each of these entries was last sent, by any beat (the database's clock)."""
    rows = PeriodicRun.objects.filter(name__in=names).values_list("name", "sent_at")
    return {name: sent for name, sent in rows if sent is not None}


@dataclass(frozen=True)
class Send:
    number: int  # counts the entry's sends, whichever beat made them
    sent_at: datetime  # by the database's clock


def claim_send(
    *, name: str, task: str, interval: float, holder: str, term: int, lease: str = BEAT
) -> Send | None:
    """Record a send of entry `name` and return it, if `holder` still holds the lease in `term`
    and the entry's last send is at least `interval` old (less CLAIM_TOLERANCE); None otherwise,
    and nothing is recorded."""
    PeriodicRun.objects.bulk_create([PeriodicRun(name=name, task=task)], ignore_conflicts=True)
    tolerance = min(CLAIM_TOLERANCE, interval / 2)
    due = Q(sent_at__isnull=True) | Q(
        sent_at__lte=Now() - Value(timedelta(seconds=interval - tolerance))
    )
    holds = Exists(Lease.objects.filter(name=lease, holder=holder, term=term, expires_at__gt=Now()))
    with transaction.atomic():
        claimed = PeriodicRun.objects.filter(due, holds, name=name).update(
            sends=F("sends") + 1, sent_at=Now(), sent_by=holder, task=task
        )
        if not claimed:
            return None
        # The row stays locked by the UPDATE until this transaction ends: this is our send.
        number, sent_at = PeriodicRun.objects.values_list("sends", "sent_at").get(name=name)
        assert sent_at is not None
        return Send(number=number, sent_at=sent_at)


def ran_send(*, name: str, send: int) -> bool:
    """Claim the running of send number `send` of entry `name`: True once, for the entry's
    latest send only; False for a send that ran already or that a later one superseded."""
    return bool(
        PeriodicRun.objects.filter(name=name, sends=send, ran__lt=send).update(
            ran=send, ran_at=Now()
        )
    )

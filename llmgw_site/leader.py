"""One beat schedule over several control planes: a lease in the database, and a claim per send.

Every beat process runs, but only the holder of the lease named "beat" sends periodic tasks;
the others stand by (llmgw_site.beat.LeaderScheduler drives these calls). With SQLite there is
one machine: the stock Celery scheduler runs, with no lease (`shared`).
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


# Why a row in the database rather than a Redis key: a send claims its row with one conditional
# UPDATE that checks, in the same statement and by the database's clock, that the sender still
# holds the lease in the term it believes, so a beat that paused past its lease sends nothing (a
# Redis lease cannot fence a write the database receives afterwards); one clock decides; and
# Redis may be restarted empty, when a lease lost with it would let two beats send at once.


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
    and nothing is recorded. So no periodic task is sent twice for one interval, whichever beats
    send it; a send whose message is lost is not sent again: the next one does that work."""
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

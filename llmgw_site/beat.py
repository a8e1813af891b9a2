"""The beat scheduler every llmgw beat runs, and the task class every llmgw task is made from.

LeaderScheduler is Celery's own PersistentScheduler with one addition where several control
planes share the database (PostgreSQL): it sends only while it holds the beat lease, and each
send first claims its entry's row (llmgw_site.leader says why the lease is in the database and
what is guaranteed). On SQLite (one machine) it is exactly the stock scheduler.

Run it as `celery -A llmgw_site beat` (CELERY_BEAT_SCHEDULER names it; the run command does), or
inside a worker, `celery -A llmgw_site worker -B --scheduler llmgw_site.beat:LeaderScheduler` (the
worker does not read the setting for its embedded beat, and does not start it again if it dies:
such a worker stops then, with exit code 70, for its supervisor to start again; llmgw_site.celery).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import secrets
import socket
import time
from datetime import UTC, datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any

from celery import Task
from celery.beat import PersistentScheduler, ScheduleEntry
from celery.exceptions import Ignore
from celery.schedules import schedule as every
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection

if TYPE_CHECKING:
    from .leader import Held

log = logging.getLogger("llmgw.beat")

# How often a standby asks for the lease: with the lease's length, the most a takeover takes.
STANDBY_SECONDS = 2.0
# A jump of the wall clock against the monotonic one larger than this, between two ticks, is a
# step (NTP setting the clock, an operator's `date -s`), not the drift a slewing clock has.
CLOCK_STEP_SECONDS = 2.0
# The message headers a send carries (the worker's PeriodicTask reads them).
ENTRY_HEADER = "llmgw_periodic"
SEND_HEADER = "llmgw_send"
BEAT_HEADER = "llmgw_beat"
SENT_AT_HEADER = "llmgw_sent_at"


def _leader() -> ModuleType:
    """llmgw_site.leader, imported at first use: it reaches the models, and this module holds
    the Celery app's task class, which Celery imports before Django's apps are loaded."""
    from . import leader  # at first use: see above

    return leader


def interval_of(entry: ScheduleEntry) -> float:
    """The least time between two sends of an entry: its interval, or a minute for crontab-like
    schedules (their resolution)."""
    if isinstance(entry.schedule, every):
        return max(entry.schedule.run_every.total_seconds(), 0.0)
    return 60.0


class LeaderScheduler(PersistentScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.shared = _leader().shared()
        self.lease_seconds = float(settings.LLMGW_BEAT_LEASE_SECONDS)
        # Unique per process: a beat restarted on the same machine is another holder, and
        # waits for the dead one's lease to run out rather than trusting it is dead.
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.held: Held | None = None
        self.renew_at = 0.0
        self._said: str | None = None
        self._wall_offset: float | None = None  # time.time() - time.monotonic() at the last tick
        super().__init__(*args, **kwargs)

    # -- the lease ----------------------------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self._follow_clock()
        if not self.shared:
            return super().tick(*args, **kwargs)
        if not self._lead():
            return min(STANDBY_SECONDS, self.lease_seconds / 5)
        delay = super().tick(*args, **kwargs)
        return max(0.0, min(delay, self.renew_at - time.monotonic()))

    def _lead(self) -> bool:
        """Whether this process may send now: it holds the lease, renewed when a third of it
        has passed."""
        leader = _leader()
        if self.held is not None and time.monotonic() < self.renew_at:
            return True
        asked = time.monotonic()
        try:
            close_old_connections()
            held = leader.take(holder=self.holder, seconds=self.lease_seconds)
            current = None if held is not None else leader.holder_of()
        except DatabaseError as exc:
            self._database_failed()
            self._say(
                f"beat: cannot reach the database to hold the lease ({_first_line(exc)}); "
                "sending nothing until it answers",
                logging.WARNING,
            )
            self.held = None
            return False
        if held is None:
            if self.held is not None:
                self._say(
                    f"beat: {self.holder} lost the lease to {current.holder if current else '?'}; "
                    "standing by",
                    logging.WARNING,
                )
            elif current is not None:
                self._say(
                    f"beat: standing by; {current.holder} runs the schedule (this beat takes "
                    f"over if that one stops renewing its {self.lease_seconds:g} s lease)"
                )
            self.held = None
            return False
        if self.held is None or held.term != self.held.term:
            self._start_term(held)
        self.held = held
        self.renew_at = asked + self.lease_seconds / 3
        return True

    def _start_term(self, held: Any) -> None:
        """Begin leading: each entry's last send is the one recorded by whichever beat sent it,
        so what came due while no beat led is sent now, and nothing is sent early."""
        sends = _leader().last_sends(list(self.schedule))
        now = self.app.now().astimezone(UTC)
        for name, entry in self.schedule.items():
            sent = sends.get(name)
            if sent is not None:
                # Never later than this beat's now: a send stamped by a database clock ahead of
                # this machine's would keep the entry from coming due until this clock caught
                # up (minutes of no reconcile pass for a clock minutes behind). Sending sooner
                # is safe: claim_send checks the interval by the database's clock.
                entry.last_run_at = min(sent.astimezone(UTC), now)
        self._heap = None  # rebuilt from the entries at the next tick
        taken = f", taken from {held.previous}" if held.previous else ""
        self._say(f"beat: {self.holder} runs the schedule now (term {held.term}{taken})")

    def _follow_clock(self) -> None:
        """After a step of the wall clock, go on from now.

        Celery decides what is due by the wall clock: each entry's last send (stamped by the
        clock before the step) plus its interval, against now. Stepped back by five minutes,
        every entry would wait five minutes more (no reconcile pass, no rollout step meanwhile),
        and the heap of entries, ordered by times from before the step, would serve first the
        entries sent since, starving the others. So the last sends in the future count as sent
        now, and the heap is made again. Stepped forward, entries come due early; claim_send
        refuses those within their interval by the database's clock, and the heap is made
        again all the same."""
        offset = time.time() - time.monotonic()
        previous, self._wall_offset = self._wall_offset, offset
        if previous is None or abs(offset - previous) <= CLOCK_STEP_SECONDS:
            return
        now = self.app.now().astimezone(UTC)
        for entry in self.schedule.values():
            if entry.last_run_at is not None and _aware(entry.last_run_at) > now:
                entry.last_run_at = now
        self._heap = None
        log.warning(
            "beat: the clock stepped by %+.0f s; the schedule goes on from the new time",
            offset - previous,
        )

    def _say(self, text: str, level: int = logging.INFO) -> None:
        # A standby asks every two seconds: say each state once, not each time.
        if text != self._said:
            log.log(level, "%s", text)
            self._said = text

    @staticmethod
    def _database_failed() -> None:
        # The connection is broken already; the next call makes a new one.
        with contextlib.suppress(Exception):
            connection.close()

    # -- sends --------------------------------------------------------------------------------

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        if not self.shared:
            return super().apply_entry(entry, producer=producer)
        held = self.held
        if held is None:
            return None
        try:
            send = _leader().claim_send(
                name=entry.name,
                task=entry.task,
                interval=interval_of(entry),
                holder=self.holder,
                term=held.term,
            )
        except DatabaseError as exc:
            self._database_failed()
            log.warning("beat: not sending %s: the database did not answer (%s)", entry.name, exc)
            self.renew_at = 0.0
            return None
        if send is None:
            # Sent by another beat within its interval, or this beat no longer holds the lease:
            # ask for the lease again before the next send.
            log.info("beat: not sending %s: it was sent less than an interval ago or this beat "
                     "lost the lease", entry.name)  # fmt: skip
            self.renew_at = 0.0
            return None
        stamped = copy.copy(entry)
        headers = {**entry.options.get("headers", {}), ENTRY_HEADER: entry.name,
                   SEND_HEADER: send.number, SENT_AT_HEADER: send.sent_at.isoformat(),
                   BEAT_HEADER: self.holder}  # fmt: skip
        stamped.options = {**entry.options, "headers": headers}
        return super().apply_entry(stamped, producer=producer)

    def close(self) -> None:
        if self.shared and self.held is not None:
            _drop_cut_connection()
            try:
                if _leader().release(holder=self.holder):
                    log.info("beat: %s released the lease", self.holder)
            except DatabaseError:
                pass  # it runs out by itself
            self.held = None
        super().close()


class PeriodicTask(Task):
    """Every llmgw task (the Celery app's task class): a send from LeaderScheduler runs only if it
    is still its entry's latest send and has not run; any other call runs as usual."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        name, send = self.request.get(ENTRY_HEADER), self.request.get(SEND_HEADER)
        if name is None or send is None:
            return
        if not _leader().ran_send(name=str(name), send=int(send)):
            log.info(
                "%s: not running send %s of %s: it ran already or a later send superseded it",
                self.name,
                send,
                name,
            )
            raise Ignore()


def _drop_cut_connection() -> None:
    """Close the database connection if a stop signal cut a query short on it (it is still mid-
    command and cannot run another); the next query opens a new one."""
    raw = connection.connection
    status = getattr(getattr(raw, "info", None), "transaction_status", None)
    if status is not None and status.name in ("ACTIVE", "UNKNOWN"):
        with contextlib.suppress(Exception):
            connection.close()


def _aware(moment: datetime) -> datetime:
    """A last send as an aware time: Celery keeps a naive one as UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]

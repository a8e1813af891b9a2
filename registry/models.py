"""The registry's rows: files in the mirror, fetches into it, and rollouts to new weights.

Their tables are named catalog_* (db_table): migration registry 0001 took the existing tables
over from the catalog app without copying a row.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from core.dbclock import database_ago

# A running fetch is leased to the worker process that claimed it (Fetch.holder) until its
# heartbeat is this old; the holder renews it every RENEW_SECONDS while it fetches, from a thread
# of its own (registry.mirror), so a slow download keeps it. A lapsed lease means the holder is
# gone (killed, its machine down, the database out of its reach for longer than this) and any
# worker may take the fetch over. It was 60 s, renewed only by progress: a dead worker's fetch
# waited a minute. Its one home: Fetch.is_orphaned says it for a row in hand,
# FetchQuerySet.orphaned for the database, and tests/registry/test_models.py holds the two together.
LEASE_SECONDS = 10
RENEW_SECONDS = 2.5


class MirrorFile(models.Model):
    """A file the mirror fetched from the registry, and exactly where it came from."""

    repo = models.CharField(max_length=200)
    commit = models.CharField(max_length=64)
    path = models.CharField(max_length=500)
    sha256 = models.CharField(max_length=64)
    size = models.BigIntegerField()
    source_url = models.CharField(max_length=2000)
    fetched_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "catalog_mirrorfile"
        constraints = [
            models.UniqueConstraint(fields=["repo", "commit", "path"], name="mirror_file_once")
        ]

    def __str__(self) -> str:
        return f"{self.repo}@{self.commit[:7]}/{self.path}"

    @property
    def relative_path(self) -> str:
        return f"{self.repo}/{self.commit}/{self.path}"


def _orphaned(now: datetime | None) -> Q:
    stale = database_ago(LEASE_SECONDS) if now is None else now - timedelta(seconds=LEASE_SECONDS)
    return Q(state=Fetch.RUNNING) & (Q(heartbeat_at__lt=stale) | Q(heartbeat_at=None))


class FetchQuerySet(models.QuerySet["Fetch"]):
    """The fetches a worker may take, as SQL; Fetch.is_orphaned and Fetch.is_claimable are the
    same rules for a row in hand. `now` None (as the workers call them): by the database's
    clock, which stamps the heartbeats (core.dbclock), so that no worker's clock stepped forward
    finds a live fetch's lease lapsed, nor one stepped back keeps a dead one's."""

    def orphaned(self, now: datetime | None = None) -> FetchQuerySet:
        """Running, its lease lapsed (no heartbeat for LEASE_SECONDS): its worker is gone."""
        return self.filter(_orphaned(now))

    def claimable(self, now: datetime | None = None) -> FetchQuerySet:
        """Queued, or orphaned: what a worker may take (Fetch.claim)."""
        return self.filter(Q(state=Fetch.QUEUED) | _orphaned(now))

    def under_way(self) -> FetchQuerySet:
        """Queued or running (Fetch.UNDER_WAY)."""
        return self.filter(state__in=Fetch.UNDER_WAY)

    def left_queued(self, due: Any) -> FetchQuerySet:
        """Queued and not (re)queued since `due`: its message may be lost."""
        return self.filter(
            Q(state=Fetch.QUEUED)
            & (Q(heartbeat_at__lt=due) | Q(heartbeat_at=None, created_at__lt=due))
        )

    def requeue(self, now: datetime | None = None) -> int:
        """Mark these fetches queued as of `now` (the database's clock when None), so that the
        next passes leave them alone for a while; how many were."""
        return self.update(
            state=Fetch.QUEUED, heartbeat_at=Now() if now is None else now, holder=""
        )


class Fetch(models.Model):
    """Bringing a repository's files at one commit into the mirror: a Celery task with progress.

    Its state changes are the methods below, each one UPDATE, so that every caller changes a
    fetch the same way: claim (queued, or running with its worker gone -> running; conditional,
    so one worker of two gets it), renew (the lease), beat (progress and heartbeat), finish
    (-> done) and fail (-> failed), the last three only by the holder of the lease, and
    refuse_model (a done fetch whose model could not be added -> failed).
    """

    QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
    STATES = [(s, s) for s in (QUEUED, RUNNING, DONE, FAILED)]
    UNDER_WAY = (QUEUED, RUNNING)

    repo = models.CharField(max_length=200)
    branch = models.CharField(max_length=200, default="main")
    commit = models.CharField(max_length=64)
    files = models.JSONField(default=list)  # [{path, sha256, size}] as the registry lists them
    state = models.CharField(max_length=10, choices=STATES, default=QUEUED, db_index=True)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    message = models.TextField(blank=True, default="")
    # For `model serve`: the model to add once the files are in, and who asked.
    serve_definition = models.JSONField(null=True, blank=True)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    door = models.CharField(max_length=20, default="api")
    # The lease's last renewal: a running fetch whose heartbeat is LEASE_SECONDS old was
    # interrupted (its worker died) and is claimed again.
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # The worker process running it (registry.holders): "" while queued. Another process of the
    # same machine that finds it gone takes the fetch back at once, lease or not.
    holder = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = FetchQuerySet.as_manager()

    class Meta:
        db_table = "catalog_fetch"

    def __str__(self) -> str:
        return f"fetch {self.pk} {self.repo}@{self.commit[:7]} ({self.state})"

    # -- the stale rule for a row in hand (its SQL twin: FetchQuerySet) --

    def is_orphaned(self, now: datetime) -> bool:
        """Running, its lease lapsed (FetchQuerySet.orphaned)."""
        return self.state == Fetch.RUNNING and (
            self.heartbeat_at is None or self.heartbeat_at < now - timedelta(seconds=LEASE_SECONDS)
        )

    def is_claimable(self, now: datetime) -> bool:
        """Queued, or orphaned (FetchQuerySet.claimable)."""
        return self.state == Fetch.QUEUED or self.is_orphaned(now)

    # -- transitions --

    @classmethod
    def claim(cls, fetch_id: int, *, holder: str = "", now: datetime | None = None) -> bool:
        """Take the fetch for the worker process `holder`: queued, or running with its lease
        lapsed. One conditional UPDATE, so of two workers only one gets True; by the database's
        clock unless a test gives `now`."""
        taken = (
            cls.objects.filter(pk=fetch_id)
            .claimable(now)
            .update(state=Fetch.RUNNING, heartbeat_at=Now() if now is None else now, holder=holder)
        )
        return taken == 1

    @classmethod
    def release(cls, fetch_id: int, holder: str, *, now: datetime | None = None) -> bool:
        """Queue again a fetch whose holder is known gone (registry.holders.is_gone), its lease
        running or not; conditional on that holder still holding it, so it is taken back once."""
        return bool(
            cls.objects.filter(pk=fetch_id, state=Fetch.RUNNING, holder=holder).requeue(now)
        )

    def _held(self) -> FetchQuerySet:
        """This row while the lease is still this instance's holder's."""
        return Fetch.objects.filter(pk=self.pk, state=Fetch.RUNNING, holder=self.holder)

    def renew(self) -> bool:
        """Keep the lease another LEASE_SECONDS; False once it is lost (taken over, or ended)."""
        return self._held().update(heartbeat_at=Now()) == 1

    def beat(self, bytes_done: int, *, message: str | None = None) -> bool:
        """Progress, which renews the lease too; False once the lease is lost."""
        changes: dict[str, object] = {"bytes_done": bytes_done, "heartbeat_at": Now()}
        if message is not None:
            changes["message"] = message
        return self._held().update(**changes) == 1

    def finish(self) -> bool:
        """Every file is in the mirror and checked; False (nothing written) when the lease was
        lost meanwhile: the worker that took the fetch over finishes it."""
        now = timezone.now()
        written = self._held().update(
            state=Fetch.DONE,
            bytes_done=self.bytes_total,
            message="",
            finished_at=now,
            heartbeat_at=Now(),
        )
        if written:
            self.state, self.bytes_done, self.message = Fetch.DONE, self.bytes_total, ""
            self.finished_at = self.heartbeat_at = now
        return bool(written)

    def fail(self, message: str) -> bool:
        """Given up, with the reason; False (nothing written) when the lease was lost meanwhile."""
        now = timezone.now()
        written = self._held().update(state=Fetch.FAILED, message=message, finished_at=now)
        if written:
            self.state, self.message, self.finished_at = Fetch.FAILED, message, now
        return bool(written)

    def refuse_model(self, message: str) -> None:
        """The files are in (done), but the model they were for could not be added: failed,
        keeping the time the fetch finished."""
        if Fetch.objects.filter(pk=self.pk, state=Fetch.DONE).update(
            state=Fetch.FAILED, message=message
        ):
            self.state, self.message = Fetch.FAILED, message


class RolloutQuerySet(models.QuerySet["Rollout"]):
    def active(self) -> RolloutQuerySet:
        """Under way: fetching or rolling (at most one per model, one_active_rollout)."""
        return self.filter(state__in=Rollout.ACTIVE)


class Rollout(models.Model):
    """Moving a model to new weights (update) or back to the previous ones (rollback).

    Its state changes are the methods below, each a conditional UPDATE that does nothing to a
    rollout that has ended already (another worker, or a rollback, ended it first):
    start_rolling (fetching -> rolling), finish (-> done), fail (-> failed), halt (-> halted),
    stop (-> failed, ended by a rollback; its last step kept); show_step and show_progress
    write what it is doing while it is under way.
    """

    FETCHING, ROLLING, DONE, FAILED, HALTED = "fetching", "rolling", "done", "failed", "halted"
    STATES = [(s, s) for s in (FETCHING, ROLLING, DONE, FAILED, HALTED)]
    ACTIVE = (FETCHING, ROLLING)

    model = models.ForeignKey("catalog.Model", on_delete=models.CASCADE, related_name="rollouts")
    kind = models.CharField(max_length=10, choices=[("update", "update"), ("rollback", "rollback")])
    state = models.CharField(max_length=10, choices=STATES, default=FETCHING, db_index=True)
    from_commit = models.CharField(max_length=64, blank=True, default="")
    to_commit = models.CharField(max_length=64, blank=True, default="")
    from_source = models.CharField(max_length=2000, blank=True, default="")
    to_source = models.CharField(max_length=2000, blank=True, default="")
    # The rollout's trace, a W3C traceparent (llmgw.tracing.begin), "" when not traced: each step
    # of it, in whichever worker, is a span there.
    trace = models.CharField(max_length=64, blank=True, default="")
    fetch = models.ForeignKey(
        Fetch, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    step = models.CharField(max_length=300, blank=True, default="")
    message = models.TextField(blank=True, default="")
    replaced = models.PositiveIntegerField(default=0)
    total = models.PositiveIntegerField(default=0)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150, default="")
    door = models.CharField(max_length=20, default="api")
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = RolloutQuerySet.as_manager()

    class Meta:
        db_table = "catalog_rollout"
        ordering = ["-created_at", "-id"]
        constraints = [
            # Two rollouts of one model at once would fight over its source.
            models.UniqueConstraint(
                fields=["model"],
                condition=models.Q(state__in=["fetching", "rolling"]),
                name="one_active_rollout",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} of {self.model_id} ({self.state})"

    # -- transitions --

    def _change(self, states: tuple[str, ...], **changes: object) -> bool:
        """Write `changes` if the row is still in one of `states`; whether it was."""
        changed = Rollout.objects.filter(pk=self.pk, state__in=states).update(**changes)
        if changed:
            for name, value in changes.items():
                setattr(self, name, value)
        return bool(changed)

    def show_step(self, step: str, *, states: tuple[str, ...] = ACTIVE) -> bool:
        """What the rollout is doing now, as the API, CLI and console show it; written only
        while it is in `states` (under way), so it never overwrites how a rollout ended."""
        return self._change(states, step=step)

    def show_progress(self, *, replaced: int, total: int, step: str | None = None) -> bool:
        """How many of the model's replicas run the new weights, of how many."""
        changes: dict[str, object] = {"replaced": replaced, "total": total}
        if step is not None:
            changes["step"] = step
        return self._change(Rollout.ACTIVE, **changes)

    def start_rolling(self) -> bool:
        """The files are in and the model points at them: replicas are replaced from now on."""
        return self._change((Rollout.FETCHING,), state=Rollout.ROLLING, step="replacing replicas")

    def finish(self, message: str) -> bool:
        """Every replica runs the new weights."""
        return self._end(Rollout.DONE, message)

    def fail(self, message: str) -> bool:
        """Ended without moving the model on (a failed fetch, a canary rolled back)."""
        return self._end(Rollout.FAILED, message)

    def halt(self, message: str) -> bool:
        """Stopped part way, the old replicas serving on (model.rollout_halted)."""
        return self._end(Rollout.HALTED, message)

    def stop(self, message: str) -> bool:
        """Ended by a rollback that takes its place; its last step stays as it was, to show
        how far it got."""
        return self._change(
            Rollout.ACTIVE, state=Rollout.FAILED, message=message, finished_at=timezone.now()
        )

    def _end(self, state: str, message: str) -> bool:
        return self._change(
            Rollout.ACTIVE, state=state, message=message, step=message, finished_at=timezone.now()
        )


class CanaryKeyMinute(models.Model):
    """What one gateway process answered one key for one model and revision in one minute, kept
    only while the model has a canary update under way (registry.canary.key_figures reads it
    for judge).

    The gateway's own traffic table (access.models.TrafficMinute) has no key: one key whose
    requests fail on both revisions alike (a body the engine cannot take) would read as the new
    revision's errors. Per key, the check can tell errors that follow the request from errors
    that follow the revision. Each process writes its own rows with the absolute totals it
    holds, as for TrafficMinute. Bounded: keys sending x 2 revisions x the minutes of the window
    (at most a day, MAX_WINDOW_SECONDS) x writers, per model under a canary; access.traffic.fold
    deletes rows older than a day.
    """

    model = models.CharField(max_length=200)
    revision = models.CharField(max_length=40)
    # The gateway key's id, not a foreign key: the registry sits below the gateway (whose
    # GatewayKey it is), and a deleted key's figures still count for the canary it took part in.
    key_id = models.BigIntegerField()
    start = models.DateTimeField(help_text="the minute the figures are for, UTC")
    writer = models.CharField(max_length=40)
    requests = models.PositiveIntegerField(default=0)
    server_errors = models.PositiveIntegerField(default=0, help_text="answers 500-599")
    seconds = models.FloatField(default=0, help_text="time spent answering, summed")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["model", "revision", "key_id", "start", "writer"],
                name="canary_key_minute_once",
            )
        ]
        indexes = [models.Index(fields=["model", "start"])]

    def __str__(self) -> str:
        return (
            f"{self.model}@{self.revision} key {self.key_id} at {self.start:%Y-%m-%d %H:%M}: "
            f"{self.requests} requests"
        )

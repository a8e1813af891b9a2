"""The registry's rows: files in the mirror, fetches into it, and rollouts to new weights.

The tables keep the names they had when these models lived in the catalog app
(migration registry 0001 moved them without copying a row).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


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


class Fetch(models.Model):
    """Bringing a repository's files at one commit into the mirror: a Celery task with progress."""

    QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
    STATES = [(s, s) for s in (QUEUED, RUNNING, DONE, FAILED)]

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
    # Refreshed while a worker downloads: a fetch whose heartbeat is old was
    # interrupted (worker restart) and is claimed again.
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "catalog_fetch"

    def __str__(self) -> str:
        return f"fetch {self.pk} {self.repo}@{self.commit[:7]} ({self.state})"


class Rollout(models.Model):
    """Moving a model to new weights (update) or back to the previous ones (rollback)."""

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


class CanaryKeyMinute(models.Model):
    """What one gateway process answered one key for one model and revision in one minute, kept
    only while the model has a canary update under way (registry.canary.judge reads it).

    The gateway's own traffic table (gateway.models.TrafficMinute) has no key: one key whose
    requests fail on both revisions alike (a body the engine cannot take) would read as the new
    revision's errors. Per key, the check can tell errors that follow the request from errors
    that follow the revision. Each process writes its own rows with the absolute totals it
    holds, as for TrafficMinute. Bounded: keys sending x 2 revisions x the minutes of the window
    (at most a day, MAX_WINDOW_SECONDS) x writers, per model under a canary; gateway.traffic.fold
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

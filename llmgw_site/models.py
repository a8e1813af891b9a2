"""What lets several control planes share one database and keep one schedule (llmgw_site.leader):
the lease that names the beat that runs the schedule, and each periodic task's last send."""

from __future__ import annotations

from django.db import models


class Lease(models.Model):
    """Held by `holder` until `expires_at` (the database's clock); taken by another only after.

    `term` grows by one each time the lease changes hands, so a send or run stamped with an old
    term is known to come from a holder that has since lost it."""

    name = models.CharField(max_length=100, primary_key=True)
    holder = models.CharField(max_length=200)
    term = models.BigIntegerField(default=1)
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name}: {self.holder} (term {self.term}) until {self.expires_at:%H:%M:%S}"


class PeriodicRun(models.Model):
    """One row per beat schedule entry: when it was last sent, by which holder, and which send
    ran. A send claims the row (a conditional UPDATE) and a worker runs only the latest claim,
    once."""

    name = models.CharField(max_length=200, primary_key=True)
    task = models.CharField(max_length=200)
    # Counts the sends; the message carries its number, the worker records the one it ran.
    sends = models.BigIntegerField(default=0)
    sent_at = models.DateTimeField(null=True)
    sent_by = models.CharField(max_length=200, blank=True)
    ran = models.BigIntegerField(default=0)
    ran_at = models.DateTimeField(null=True)

    def __str__(self) -> str:
        return f"{self.name}: send {self.sends} at {self.sent_at} by {self.sent_by or '-'}"

"""Reads of canaries: those under way, one model's canary as the API, CLI and console show
it, and the per-key figures the check weighs (registry.models.CanaryKeyMinute)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from django.db.models import Sum

from catalog.models import Model
from core.durations import format_duration

from ..models import CanaryKeyMinute, Rollout
from .rule import RevisionFigures

# The gateway writes its figures by the minute (access.traffic.MINUTE).
MINUTE = 60


def active_canaries() -> list[Model]:
    return [m for m in Model.objects.exclude(canary=None) if m.canary_in_force is not None]


def canary_view(model: Model) -> dict[str, Any] | None:
    """A model's canary (under way, or the last one's outcome) as the API, CLI and console show
    it; None when it never had one."""
    canary = model.canary
    if not isinstance(canary, dict):
        return None
    figures = canary.get("figures") or {}

    def side(name: str) -> dict[str, Any]:
        seen = RevisionFigures(**(figures.get(name) or {}))
        return {
            "requests": seen.requests,
            "server_errors": seen.errors,
            "error_rate": seen.error_rate,
            "mean_latency": seen.mean_latency,
        }

    return {
        "model": model.name,
        "state": canary.get("state", ""),
        "active": model.canary_in_force is not None,
        "percent": canary.get("percent", 0),
        "from_commit": canary.get("from_commit", ""),
        "to_commit": canary.get("to_commit", ""),
        "from_revision": canary.get("from_revision", ""),
        "revision": canary.get("revision", ""),
        "window": format_duration(int(canary.get("window_seconds") or 0)),
        "max_error_rate": canary.get("max_error_rate", 0.0),
        "max_latency_ratio": canary.get("max_latency_ratio", 0.0),
        "asked_by": canary.get("asked_by", ""),
        "started_at": canary.get("started_at"),
        "ends_at": canary.get("ends_at"),
        "checks": canary.get("checks", 0),
        "checked_at": canary.get("checked_at"),
        "old": side("old"),
        "new": side("new"),
        # Judged per key (see judge): how many keys the new revision answered, how many of
        # them failed there beyond their own old-revision rate, and those excess errors.
        "keys": figures.get("keys") or {"sending": 0, "with_excess": 0, "excess_errors": 0},
        "verdict": canary.get("verdict", ""),
        "decided_by": canary.get("decided_by", ""),
        "decision": canary.get("decision", ""),
        "decided_at": canary.get("decided_at"),
    }


def canaries() -> list[dict[str, Any]]:
    """Every model's canary, those under way first, then the last outcomes by name."""
    views = [v for v in (canary_view(m) for m in Model.objects.exclude(canary=None)) if v]
    return sorted(views, key=lambda v: (not v["active"], v["model"]))


def describe_figures(figures: Any) -> str:
    """Both revisions' figures in one sentence, for audit notes and the command line."""
    if not isinstance(figures, dict):
        return "No figures were checked yet."
    parts = []
    for side in ("old", "new"):
        seen = RevisionFigures(**(figures.get(side) or {}))
        latency = "-" if seen.mean_latency is None else f"{seen.mean_latency:.3f} s"
        parts.append(
            f"{side} revision: {seen.requests} requests, {seen.errors} server errors, "
            f"mean latency {latency}"
        )
    keys = figures.get("keys")
    if isinstance(keys, dict):
        parts.append(
            f"{keys.get('excess_errors', 0):g} server errors beyond what each key saw on the old "
            f"revision, from {keys.get('with_excess', 0)} of {keys.get('sending', 0)} keys"
        )
    return "; ".join(parts) + "."


def rollout_of(canary: dict[str, Any]) -> Rollout | None:
    rollout_id = canary.get("rollout")
    if not isinstance(rollout_id, int):
        return None
    return Rollout.objects.filter(pk=rollout_id).first()


def key_figures(
    names: Iterable[str], revisions: Iterable[str], since: datetime
) -> dict[int, dict[str, RevisionFigures]]:
    """What the gateway processes answered each key for these names on these revisions, from
    the minute of `since` on; one query, summed in the database (a row per key and revision)."""
    epoch = int(since.timestamp())
    start = datetime.fromtimestamp(epoch - epoch % MINUTE, UTC)
    rows = (
        CanaryKeyMinute.objects.filter(
            model__in=list(names), revision__in=list(revisions), start__gte=start
        )
        .values("key_id", "revision")
        .annotate(
            total_requests=Sum("requests"),
            total_errors=Sum("server_errors"),
            total_seconds=Sum("seconds"),
        )
        .order_by()
    )
    found: dict[int, dict[str, RevisionFigures]] = {}
    for row in rows:
        found.setdefault(row["key_id"], {})[row["revision"]] = RevisionFigures(
            requests=row["total_requests"] or 0,
            errors=row["total_errors"] or 0,
            seconds=row["total_seconds"] or 0.0,
        )
    return found


def names_counted(model: Model) -> list[str]:
    """The names the gateway counts a model's answers under: the model and its adapters."""
    return [model.name, *(a["name"] for a in model.adapters)]

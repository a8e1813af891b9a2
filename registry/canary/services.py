"""The canary's lifecycle: started with an update, its window opened when its replica is
ready, checked against the figures, promoted or rolled back (by the check or by hand). Every
change of state writes its audit entry in the same transaction."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from catalog.models import CANARY_ACTIVE, Model, projector_of
from catalog.services import (
    announce,
    get_model,
    lock_catalog,
    record_change,
    record_event,
    require_change_rights,
)
from core.actor import SYSTEM, Actor
from core.dbclock import database_now
from core.durations import format_duration
from core.refusals import conflict
from fleet.models import Replica
from fleet.specs import model_revision, replica_revision, weights_revision

from ..models import Rollout
from ..rollouts import start_update
from .rule import (
    CanarySettings,
    KeyFigures,
    Outcome,
    RevisionFigures,
    Verdict,
    judge,
    stored_settings,
)
from .selectors import describe_figures, rollout_of

# -- starting -----------------------------------------------------------------------------


def start_canary_update(*, actor: Actor, name: str, settings_: CanarySettings) -> Rollout:
    """An update whose new revision first serves `percent` of the requests on one replica."""
    with transaction.atomic():
        lock_catalog()
        model = get_model(name)
        require_change_rights(actor, model)
        before = {"previous": model.previous, "update_available": model.update_available}
        rollout = start_update(actor=actor, name=name)
        fetch = rollout.fetch
        assert fetch is not None
        weights = next(
            (f for f in fetch.files if rollout.to_source.endswith("/" + f["path"])), fetch.files[0]
        )
        canary = {
            "state": "waiting",
            "rollout": rollout.pk,
            "percent": settings_.percent,
            "revision": weights_revision(
                rollout.to_source, weights.get("sha256"), _new_projector(model, rollout)
            ),
            "from_revision": model_revision(model),
            "from_commit": rollout.from_commit,
            "to_commit": rollout.to_commit,
            "window_seconds": settings_.window_seconds,
            "max_error_rate": settings_.max_error_rate,
            "max_latency_ratio": settings_.max_latency_ratio,
            "asked_by": actor.name,
            "asked_at": timezone.now().isoformat(),
            "started_at": None,
            "ends_at": None,
            "checks": 0,
            "checked_at": None,
            "figures": None,
            "verdict": "",
            # What a rollback restores besides the files (the swap overwrites them).
            "restore": before,
        }
        Model.objects.filter(pk=model.pk).update(canary=canary)
        record_change(
            actor,
            model.name,
            "canary",
            None,
            {
                k: canary[k]
                for k in ("percent", "window_seconds", "max_error_rate", "max_latency_ratio")
            },
            note=f"canary update asked for: {settings_.percent}% of the requests to "
            f"{rollout.to_commit[:7]} for {format_duration(settings_.window_seconds)}, rolled "
            f"back when server errors exceed {settings_.max_error_rate:.1%} or latency "
            f"{settings_.max_latency_ratio:g} times the old revision's",
        )
        rollout.show_step(
            f"fetching the new files into the mirror; then a canary serves {settings_.percent}%"
        )
        rollout.refresh_from_db()
    return rollout


def _new_projector(model: Model, rollout: Rollout) -> dict[str, Any] | None:
    """The vision projector the update brings (its fetch lists it with the weights), as a
    replica's spec holds it; None for a text model."""
    fetch = rollout.fetch
    origin = {"files": fetch.files} if fetch is not None else None
    projector = projector_of(rollout.to_source, model.mmproj, origin)
    return projector.spec() if projector else None


# -- progress and checks -------------------------------------------------------------------


def advance_canary(
    model: Model,
    *,
    baseline: dict[str, RevisionFigures] | None = None,
    now: datetime | None = None,
    counted_from: datetime | None = None,
) -> bool:
    """Start the window once the canary replica is ready; end a canary whose rollout ended or
    whose replica cannot start. True when the window started now.

    `now` is the database's clock (core.dbclock), which measures the window. `baseline` is what
    the gateway's figures (from the minute of `counted_from`, `now` when not given) held at the
    start: the checks count what came after it from that same minute, so requests before the
    window (and a canary of the same revision tried a moment before) decide nothing."""
    now = now or database_now()
    canary = model.canary or {}
    rollout = rollout_of(canary)
    if rollout is None or rollout.state not in Rollout.ACTIVE:
        why = rollout.message if rollout is not None else "its rollout is gone"
        _end(model.pk, "ended", f"the update ended before the canary was decided: {why}")
        return False
    if model.rollout_halted:
        _roll_back(
            model.name,
            SYSTEM,
            f"the canary replica could not start: {model.rollout_halted}",
            figures=canary.get("figures"),
        )
        return False
    if canary.get("state") != "waiting" or rollout.state != Rollout.ROLLING:
        return False
    ready = Replica.objects.filter(
        model=model, state=Replica.READY, withdrawn_at__isnull=True
    ).values_list("spec", flat=True)
    if not any(replica_revision(spec) == canary["revision"] for spec in ready):
        rollout.show_step(_step(canary), states=(Rollout.ROLLING,))
        return False
    with transaction.atomic():
        lock_catalog()
        current = Model.objects.get(pk=model.pk)
        canary = current.canary or {}
        if canary.get("state") != "waiting":
            return False
        ends = now + timedelta(seconds=canary["window_seconds"])
        canary = {
            **canary,
            "state": "watching",
            "started_at": now.isoformat(),
            "ends_at": ends.isoformat(),
            "counted_from": (counted_from or now).isoformat(),
            "baseline": {rev: asdict(seen) for rev, seen in (baseline or {}).items()},
        }
        Model.objects.filter(pk=model.pk).update(canary=canary)
        rollout.show_step(_step(canary))
        record_event(
            SYSTEM,
            current.name,
            "canary-start",
            f"the canary replica is ready: {canary['percent']}% of the requests go to "
            f"{canary['to_commit'][:7]} until {ends:%H:%M:%S} UTC",
        )
    return True


def check_canary(
    model: Model,
    figures: dict[str, RevisionFigures],
    *,
    keys: dict[int, dict[str, RevisionFigures]] | None = None,
    min_requests: int | None = None,
    now: datetime | None = None,
) -> Verdict | None:
    """One check of a watching canary against the gateway's figures per revision (from the
    minute the canary counts from, its `counted_from`; its baseline is taken off); rolls it back or promotes it when
    that is decided. None when the canary is not watching.

    `keys` holds each gateway key's figures per revision (registry.models.CanaryKeyMinute),
    from that same minute: judge weighs errors per key with them. They carry no
    baseline of their own (that would be a row per key in the canary's record), so the answers
    from before the window back to the minute it counts from (check.COUNTED_CLOCK_SLACK) count in
    them; they only ever compare a key's two revisions with each other, which such answers
    leave fair.

    `now` is the database's clock (core.dbclock): the window is over by it."""
    now = now or database_now()
    canary = model.canary or {}
    if canary.get("state") != "watching":
        return None
    min_requests = settings.LLMGW_CANARY_MIN_REQUESTS if min_requests is None else min_requests
    baseline = canary.get("baseline") or {}
    old = _since(figures.get(canary["from_revision"]), baseline.get(canary["from_revision"]))
    new = _since(figures.get(canary["revision"]), baseline.get(canary["revision"]))
    ends = datetime.fromisoformat(canary["ends_at"])
    per_key = {
        key: KeyFigures(
            old=sides.get(canary["from_revision"]) or RevisionFigures(),
            new=sides.get(canary["revision"]) or RevisionFigures(),
        )
        for key, sides in (keys or {}).items()
    }
    verdict = judge(
        old,
        new,
        stored_settings(canary),
        min_requests=min_requests,
        window_over=now >= ends,
        keys=per_key or None,
    )
    seen: dict[str, Any] = {"old": asdict(old), "new": asdict(new), "at": now.isoformat()}
    if verdict.excess is not None:
        seen["keys"] = verdict.excess.summary()
    with transaction.atomic():
        lock_catalog()
        current = Model.objects.get(pk=model.pk)
        canary = current.canary or {}
        if canary.get("state") != "watching":
            return None
        canary = {
            **canary,
            "checks": canary.get("checks", 0) + 1,
            "checked_at": now.isoformat(),
            "figures": seen,
            "verdict": verdict.reason,
        }
        Model.objects.filter(pk=model.pk).update(canary=canary)
        _show_step(canary, _step(canary))
    if verdict.outcome is Outcome.UNHEALTHY:
        _roll_back(model.name, SYSTEM, f"unhealthy: {verdict.reason}", figures=seen)
    elif verdict.outcome is Outcome.HEALTHY:
        _promote(model.name, SYSTEM, verdict.reason, figures=seen)
    return verdict


def _since(total: RevisionFigures | None, baseline: dict[str, Any] | None) -> RevisionFigures:
    total = total or RevisionFigures()
    before = RevisionFigures(**(baseline or {}))
    return RevisionFigures(
        requests=max(total.requests - before.requests, 0),
        errors=max(total.errors - before.errors, 0),
        seconds=max(total.seconds - before.seconds, 0.0),
    )


def _step(canary: dict[str, Any]) -> str:
    if canary["state"] == "waiting":
        return f"canary: waiting for its replica to be ready; it then gets {canary['percent']}% of the requests"
    figures = canary.get("figures") or {}
    new = figures.get("new") or {}
    return (
        f"canary: {canary['percent']}% of the requests to {canary['to_commit'][:7]} until "
        f"{canary['ends_at'][11:19]} UTC; {canary.get('checks', 0)} checks, "
        f"{new.get('requests', 0)} answers from it so far"
    )


# -- by hand ------------------------------------------------------------------------------


def promote_canary(*, actor: Actor, name: str) -> Model:
    """The replacement goes on now, one replica at a time, whatever the figures say."""
    model = get_model(name)
    require_change_rights(actor, model)
    _require_canary(model)
    _promote(name, actor, f"promoted by {actor.name}", figures=(model.canary or {}).get("figures"))
    return get_model(name)


def abort_canary(*, actor: Actor, name: str) -> Model:
    """Back to the old revision now: the canary replica goes, the old ones serve on."""
    model = get_model(name)
    require_change_rights(actor, model)
    _require_canary(model)
    _roll_back(name, actor, f"aborted by {actor.name}", figures=(model.canary or {}).get("figures"))
    return get_model(name)


def _require_canary(model: Model) -> None:
    if model.canary_in_force is None:
        last = (model.canary or {}).get("state")
        raise conflict(
            f"{model.name} has no canary under way"
            + (f" (the last one was {last})" if last else "")
            + f". Start one with `llmgw ctl model update {model.name} --canary PERCENT`.",
            code="no_canary",
        )


# -- the two ends -------------------------------------------------------------------------


def _promote(name: str, actor: Actor, reason: str, *, figures: Any) -> None:
    with transaction.atomic():
        lock_catalog()
        model = Model.objects.get(name=name)
        canary = model.canary or {}
        if canary.get("state") not in CANARY_ACTIVE:
            return
        canary = {
            **canary,
            "state": "promoted",
            "decided_by": actor.name,
            "decision": reason,
            "decided_at": timezone.now().isoformat(),
        }
        Model.objects.filter(pk=model.pk).update(canary=canary)
        _show_step(
            canary, f"canary promoted ({reason}); replacing the other replicas one at a time"
        )
        record_change(
            actor,
            model.name,
            "canary-promote",
            None,
            {"figures": figures},
            note=f"canary of {canary['to_commit'][:7]} promoted: {reason}; the other replicas "
            f"move to it one at a time. {describe_figures(figures)}",
        )
        announce(model.name)


def _roll_back(name: str, actor: Actor, reason: str, *, figures: Any) -> None:
    """The model points at its old files again and the update ends as failed; the canary
    replica is then out of date and leaves (the old replicas never stopped)."""
    with transaction.atomic():
        lock_catalog()
        model = Model.objects.get(name=name)
        canary = model.canary or {}
        if canary.get("state") not in CANARY_ACTIVE:
            return
        rollout = rollout_of(canary)
        swapped = rollout is not None and rollout.state == Rollout.ROLLING
        if swapped and model.previous:
            restore = canary.get("restore") or {}
            target = model.previous
            model.source, model.sha256, model.origin = (
                target["source"],
                target.get("sha256", ""),
                target.get("origin"),
            )
            model.previous = restore.get("previous")
            model.update_available = restore.get("update_available")
        state = "rolled back" if actor is SYSTEM else "aborted"
        model.canary = {
            **canary,
            "state": state,
            "decided_by": actor.name,
            "decision": reason,
            "decided_at": timezone.now().isoformat(),
        }
        model.save(
            update_fields=[
                "source",
                "sha256",
                "origin",
                "previous",
                "update_available",
                "canary",
                "updated_at",
            ]
        )
        if rollout is not None:
            rollout.fail(f"canary {state}: {reason}. The old revision serves on.")
        record_change(
            actor,
            model.name,
            "canary-rollback",
            {"commit": canary.get("to_commit"), "figures": figures},
            {"commit": canary.get("from_commit")},
            note=f"canary of {canary.get('to_commit', '')[:7]} {state}: {reason}; back to "
            f"{canary.get('from_commit', '')[:7]}. {describe_figures(figures)}",
        )
        announce(model.name)


def _show_step(canary: dict[str, Any], step: str) -> None:
    rollout = rollout_of(canary)
    if rollout is not None:
        rollout.show_step(step)


def _end(model_id: int, state: str, reason: str) -> None:
    with transaction.atomic():
        model = Model.objects.select_for_update().get(pk=model_id)
        canary = model.canary or {}
        if canary.get("state") not in CANARY_ACTIVE:
            return
        Model.objects.filter(pk=model_id).update(
            canary={**canary, "state": state, "decision": reason}
        )
        record_event(SYSTEM, model.name, "canary-end", reason)

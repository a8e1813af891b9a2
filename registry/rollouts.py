"""Rollouts: move a model to newer registry weights (update) and back (rollback).

A rollout is a row whose state a Celery beat task advances (fetching -> rolling
-> done/failed/halted); every step is idempotent and reads its state from the
database, so a worker, beat or web restart in the middle of an update resumes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.utils import timezone

from catalog.config import current_config
from catalog.models import Model
from catalog.services import (
    announce,
    get_model,
    lock_catalog,
    record_change,
    record_event,
    refuse_if_declared,
    require_change_rights,
)
from core.actor import SYSTEM, Actor
from core.refusals import Refused, conflict
from fleet.models import Replica
from fleet.specs import current_keys
from llmgw.tracing import begin, continued, mark_failed, trace_id_of
from llmgw.units import format_progress

from .mirror import clean_mirror, file_url, parse_mirror_url, refuse_past_mirror_room
from .models import Fetch, Rollout
from .queue import queue_now, queue_on_commit
from .quota import file_key, refuse_past_serve_quota

log = logging.getLogger("registry.rollouts")


# -- update and rollback ----------------------------------------------------------


def _refuse_if_rolling(model: Model) -> None:
    active = Rollout.objects.filter(model=model).active().first()
    if active is not None:
        raise conflict(
            f"An {active.kind} of {model.name} is already under way (asked by {active.actor_name}, "
            f"{active.state}); wait for it, or follow it with `llmgw ctl model {active.kind} {model.name} --wait`.",
            code="rollout_in_progress",
        )


def _model_to_move(actor: Actor, name: str, what: str) -> Model:
    """What an update and a rollback ask first, under the catalog lock: the model, the right to
    change it, and that server.yaml does not declare its source."""
    lock_catalog()
    model = get_model(name)
    require_change_rights(actor, model)
    refuse_if_declared(model, f"{what} made here would revert then (its source is in the file)")
    return model


def start_update(*, actor: Actor, name: str) -> Rollout:
    """Fetch the newer files beside the old ones; the swap and the replacement follow by themselves."""
    with transaction.atomic():
        model = _model_to_move(actor, name, "an update")
        _refuse_if_rolling(model)
        if not model.origin:
            raise Refused(
                f"{model.name} was not served from the registry, so there is nothing to update it from. "
                "Use `llmgw ctl model serve REPO` for a model that follows the registry.",
                code="no_origin",
            )
        update = model.update_available
        if not update:
            raise Refused(
                f"No newer weights are known for {model.name} (on {model.origin['commit'][:7]}). "
                "Run `llmgw ctl model updates --check` to ask the registry now.",
                code="no_update",
            )
        repo, new_commit = model.origin["repo"], update["commit"]
        changed = {f["path"]: f for f in update["files"]}
        files = [changed.get(f["path"], f) for f in model.origin["files"]]
        in_mirror = parse_mirror_url(model.source)
        weights_path = in_mirror[2] if in_mirror else files[0]["path"]
        # The old files stay for a rollback, so the changed ones are new bytes in the mirror.
        refuse_past_serve_quota(
            actor,
            f"update {model.name}",
            {file_key(repo, new_commit, f): f["size"] for f in changed.values()},
        )
        refuse_past_mirror_room(f"update {model.name}", repo, list(changed.values()))
        fetch = Fetch.objects.create(
            repo=repo,
            branch=model.origin.get("branch", "main"),
            commit=new_commit,
            files=files,
            bytes_total=sum(f["size"] for f in files),
            requested_by=actor.user,
            door=actor.door,
        )
        trace = begin(
            f"rollout {model.name}: update",
            {"llmgw.model": model.name, "llmgw.from_commit": model.origin["commit"],
             "llmgw.to_commit": new_commit},
        )  # fmt: skip
        rollout = Rollout.objects.create(
            model=model,
            kind="update",
            state=Rollout.FETCHING,
            trace=trace,
            from_commit=model.origin["commit"],
            to_commit=new_commit,
            from_source=model.source,
            to_source=file_url(repo, new_commit, weights_path),
            fetch=fetch,
            step="fetching the new files into the mirror",
            requested_by=actor.user,
            actor_name=actor.name,
            door=actor.door,
        )
        record_change(
            actor,
            model.name,
            "update",
            {"commit": model.origin["commit"]},
            {"commit": new_commit},
            note=f"update asked for: {model.origin['commit'][:7]} -> {new_commit[:7]}, fetching "
            f"{len(changed)} changed file(s)",
            trace_id=trace_id_of(trace),
        )
        queue_on_commit("registry.tasks.run_fetch", fetch.pk)
    return rollout


def start_rollback(*, actor: Actor, name: str) -> Rollout:
    """Go back to the previous files (kept in the mirror); an update under way is stopped."""
    with transaction.atomic():
        model = _model_to_move(actor, name, "a rollback")
        if model.canary_in_force is not None:
            # Its rollout has not swapped for good: going back is the canary's abort, which
            # also restores what a later rollback returns to.
            raise conflict(
                f"A canary of {model.name} is under way; to go back to the old revision abort it "
                f"with `llmgw ctl model canary abort {model.name}` (the old replicas never stopped).",
                code="canary_in_progress",
            )
        if not model.previous:
            raise Refused(
                f"{model.name} has no previous weights to go back to: it was never updated.",
                code="no_previous",
            )
        for active in Rollout.objects.filter(model=model).active():
            active.stop(f"stopped by a rollback asked for by {actor.name}")
        current_commit = (model.origin or {}).get("commit", "")
        target = model.previous
        to_commit = (target.get("origin") or {}).get("commit", "")
        trace = begin(
            f"rollout {model.name}: rollback",
            {"llmgw.model": model.name, "llmgw.from_commit": current_commit,
             "llmgw.to_commit": to_commit},
        )  # fmt: skip
        rollout = Rollout.objects.create(
            model=model,
            kind="rollback",
            state=Rollout.ROLLING,
            trace=trace,
            from_commit=current_commit,
            to_commit=to_commit,
            from_source=model.source,
            to_source=target["source"],
            step="replacing replicas",
            requested_by=actor.user,
            actor_name=actor.name,
            door=actor.door,
        )
        model.update_available = update_left_by_rollback(model, target.get("origin"))
        _swap(model, target["source"], target.get("sha256", ""), target.get("origin"))
        record_change(
            actor,
            model.name,
            "rollback",
            {"commit": current_commit, "source": rollout.from_source},
            {"commit": rollout.to_commit, "source": rollout.to_source},
            note=f"rollback: {current_commit[:7]} -> {rollout.to_commit[:7]}",
            trace_id=trace_id_of(trace),
        )
        announce(model.name)
    return rollout


def update_left_by_rollback(model: Model, back_to: dict[str, Any] | None) -> dict[str, Any] | None:
    """The update a model has once rolled back to the files of `back_to` (an origin): the newest
    revision known, its files compared with those of `back_to`.

    Why: the update that moved the model on cleared update_available, and the check asks the
    registry again only when the branch moves, so a rollback that left it empty hid the newer
    revision (in `model updates`, the API and the console's badge) until the branch moved.

    The newest known is the update the last check saw, when there is one and it is not what the
    rollback goes to (going back to it, as after a rollback of a rollback, leaves none); else the
    revision rolled back from, which no check found older. `rolled_back_from` says so."""
    current, known = model.origin, model.update_available
    if not current or not back_to or current.get("repo") != back_to.get("repo"):
        return known  # not followed in the registry: nothing to compare
    if known and known.get("commit") == back_to.get("commit"):
        return None
    newest = {f["path"]: f for f in current.get("files", [])}
    if known:
        # The check's files are those that changed from the current origin; the others are the same.
        newest.update({f["path"]: f for f in known.get("files", [])})
        commit, checked_at = known["commit"], known.get("checked_at")
    else:
        commit = current["commit"]
        checked_at = (model.update_checked_at or timezone.now()).isoformat()
    if commit == back_to.get("commit"):
        return None
    old = {f["path"]: f.get("sha256") for f in back_to.get("files", [])}
    changed = [f for path, f in newest.items() if path in old and f.get("sha256") != old[path]]
    if not changed:
        return None
    return {
        "commit": commit,
        "files": changed,
        "bytes": sum(f["size"] for f in changed),
        "checked_at": checked_at,
        "rolled_back_from": current["commit"],
    }


def _swap(model: Model, source: str, sha256: str, origin: dict[str, Any] | None) -> None:
    """Point the model at other files, keeping the current ones as what a rollback returns to."""
    model.previous = {"source": model.source, "sha256": model.sha256, "origin": model.origin}
    model.source, model.sha256, model.origin = source, sha256, origin
    if (
        origin
        and model.update_available
        and model.update_available.get("commit") == origin.get("commit")
    ):
        model.update_available = None
    model.save(
        update_fields=["previous", "source", "sha256", "origin", "update_available", "updated_at"]
    )


# -- advancing rollouts -----------------------------------------------------------


def advance_rollouts() -> None:
    """Move every rollout under way one step on; safe to run at any time, from any worker."""
    for rollout in Rollout.objects.active().select_related("model", "fetch"):
        try:
            if rollout.state == Rollout.FETCHING:
                _advance_fetching(rollout)
            elif rollout.state == Rollout.ROLLING:
                _advance_rolling(rollout)
        except Exception:  # one broken rollout must not stop the others
            log.exception("could not advance rollout %s", rollout.pk)


def _actor_of(rollout: Rollout) -> Actor:
    if rollout.requested_by is not None:
        return Actor.for_user(rollout.requested_by, rollout.door)
    return SYSTEM


def _advance_fetching(rollout: Rollout) -> None:
    fetch = rollout.fetch
    if fetch is None:
        _end(rollout, rollout.fail, "the fetch of the new files disappeared")
        return
    if fetch.state == Fetch.FAILED:
        _end(rollout, rollout.fail, f"refused, the model is unchanged: {fetch.message}")
        return
    if fetch.state != Fetch.DONE:
        if Fetch.objects.filter(pk=fetch.pk).claimable().exists():  # the database's clock
            queue_now("registry.tasks.run_fetch", fetch.pk)  # resumes an interrupted fetch
        done = format_progress(fetch.bytes_done, fetch.bytes_total)
        rollout.show_step(f"fetching the new files into the mirror: {done}")
        return
    with transaction.atomic():
        lock_catalog()
        model = Model.objects.select_related("owner").get(pk=rollout.model_id)
        if not Rollout.objects.filter(pk=rollout.pk, state=Rollout.FETCHING).exists():
            return  # another worker took this step (or a rollback ended the rollout)
        repo = fetch.repo
        origin = {
            "repo": repo,
            "branch": fetch.branch,
            "commit": fetch.commit,
            "files": [
                {"path": f["path"], "sha256": f["sha256"], "size": f["size"]} for f in fetch.files
            ],
        }
        weights = next(
            (f for f in fetch.files if rollout.to_source.endswith("/" + f["path"])), fetch.files[0]
        )
        with continued(rollout.trace, "swap", {"llmgw.to_source": rollout.to_source}):
            _swap(model, rollout.to_source, weights.get("sha256") or "", origin)
            rollout.start_rolling()
            record_change(
                _actor_of(rollout),
                model.name,
                "update-swap",
                {"source": rollout.from_source},
                {"source": rollout.to_source},
                note=f"new files fetched and checked; replicas move to {fetch.commit[:7]} one at "
                "a time",
                trace_id=trace_id_of(rollout.trace),
            )
        announce(model.name)


def _advance_rolling(rollout: Rollout) -> None:
    model = rollout.model
    if model.canary_in_force is not None:
        return  # a canary holds the replacement; registry.canary moves it on
    if model.rollout_halted:
        _end(
            rollout,
            rollout.halt,
            f"{model.rollout_halted}. The old replicas keep serving; a rollback goes back.",
        )
        return
    keys = current_keys(model)
    active = list(Replica.objects.filter(model=model, withdrawn_at__isnull=True))
    fresh_ready = [
        r for r in active if r.spec_key == keys.get(r.profile) and r.state == Replica.READY
    ]
    stale = [r for r in active if r.spec_key != keys.get(r.profile)]
    desired = model.desired_replicas(timezone.now(), current_config().default_idle_timeout)
    total = max(desired, len(fresh_ready))
    if not stale and len(fresh_ready) >= desired:
        rollout.show_progress(replaced=total, total=total)
        _end(
            rollout,
            rollout.finish,
            f"every replica runs {rollout.to_commit[:7] or 'the new files'}",
        )
        return
    waiting = [r for r in active if r.spec_key == keys.get(r.profile) and r.state != Replica.READY]
    step = f"replaced {len(fresh_ready)} of {total}"
    if waiting:
        step += f"; a new replica is {waiting[0].state}"
    if rollout.step != step:
        # Each step that changes is a span of the rollout's trace (not each pass that finds
        # nothing new).
        with continued(
            rollout.trace, step, {"llmgw.replaced": len(fresh_ready), "llmgw.total": total}
        ):
            rollout.show_progress(replaced=len(fresh_ready), total=total, step=step)
    else:
        rollout.show_progress(replaced=len(fresh_ready), total=total, step=step)


def _end(rollout: Rollout, transition: Callable[[str], bool], message: str) -> None:
    """End the rollout by `transition` (its finish, fail or halt) and write the audit event in
    the same transaction; nothing when another worker ended it first."""
    with transaction.atomic():
        if not transition(message):
            return
        action = f"{rollout.kind}-{rollout.state}"
        with continued(rollout.trace, action, {"llmgw.message": message}) as span:
            if span is not None and rollout.state != Rollout.DONE:
                mark_failed(span, message)
            record_event(
                SYSTEM, rollout.model.name, action, message, trace_id=trace_id_of(rollout.trace)
            )
    if rollout.state == Rollout.DONE:
        clean_mirror()

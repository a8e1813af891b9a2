"""Registry updates: serve a repository's weights, notice newer ones, move a model to them and back.

A rollout is a row whose state a Celery beat task advances (fetching -> rolling
-> done/failed/halted); every step is idempotent and reads its state from the
database, so a worker, beat or web restart in the middle of an update resumes it.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from .definitions import clean_definition
from .errors import CatalogError, conflict
from .mirror import file_url, origin_for_source, parse_mirror_url
from .models import AuditEntry, Fetch, Model, Rollout
from .registry import Registry, RegistryError, UnknownBranch, UnknownRepository, match_files
from .services import (
    SYSTEM,
    Actor,
    announce,
    catalog_snapshot,
    get_model,
    lock_catalog,
    model_add,
    record_change,
    refuse_if_declared,
    refuse_if_invalid,
    require_change_rights,
)

log = logging.getLogger("catalog.updates")


def _kick_now(task_name: str, *args: Any) -> None:
    """Queue a task; beat runs the same work shortly if the broker is away."""
    from django.conf import settings

    if not settings.LLMGW_KICK_RECONCILE:
        return
    from llmgw_site.celery import app

    try:
        app.send_task(task_name, args=args)
    except Exception as exc:
        log.warning("could not queue %s (%s); beat will pick it up", task_name, exc)


def _kick(task_name: str, *args: Any) -> None:
    """Queue a task once the current transaction commits (never for a rolled-back change)."""
    transaction.on_commit(lambda: _kick_now(task_name, *args))


# -- serve ------------------------------------------------------------------------


def _default_name(path: str) -> str:
    stem = path.rsplit("/", 1)[-1].removesuffix(".gguf").lower()
    return re.sub(r"[^a-z0-9._:-]+", "-", stem).strip("-")[:100] or "model"


def serve_start(
    *,
    actor: Actor,
    repo: str,
    pattern: str = "*.gguf",
    branch: str = "main",
    name: str | None = None,
    memory_gb: float | None = None,
    cores: float | None = None,
    min_replicas: int = 1,
    max_replicas: int | None = None,
) -> Fetch:
    """Start fetching one GGUF file of a repository into the mirror; the model is added when it is in."""
    registry = Registry()
    try:
        commit = registry.branch_head(repo, branch)
        matches = [
            f
            for f in match_files(registry.files(repo, commit), pattern)
            if f.path.endswith(".gguf")
        ]
    except UnknownBranch as exc:
        raise CatalogError(f"Cannot serve {repo}: {exc}.", code="unknown_branch") from None
    except UnknownRepository as exc:
        raise CatalogError(
            f"Cannot serve {repo}: {exc}. Check the name (ORG/NAME, as on the registry).",
            code="unknown_repository",
            status=404,
        ) from None
    except RegistryError as exc:
        raise CatalogError(
            f"Cannot serve {repo}: {exc}. Check that the registry is up and try again.",
            code="registry_error",
            status=502,
        ) from None
    if not matches:
        raise CatalogError(
            f"{repo} has no GGUF file matching {pattern!r} on {branch} ({commit[:7]}). "
            "Name the file with a pattern (a glob such as '*q4_k_m.gguf').",
            code="no_match",
        )
    if len(matches) > 1:
        names = ", ".join(f.path for f in matches[:10])
        raise CatalogError(
            f"{len(matches)} GGUF files of {repo} match {pattern!r}: {names}. A model serves one; "
            "narrow the file pattern.",
            code="ambiguous",
        )
    weights = matches[0]
    size_gib = weights.size / 2**30
    definition = clean_definition(
        {
            "name": name or _default_name(weights.path),
            "source": file_url(repo, commit, weights.path),
            "description": f"{weights.path} from {repo} ({branch})",
            "min_replicas": min_replicas,
            "max_replicas": max_replicas,
            "profiles": [
                {
                    "name": "cpu",
                    # Weights plus room for the KV cache and the engine when not given.
                    "memory_gb": memory_gb
                    if memory_gb is not None
                    else max(1, math.ceil(size_gib * 1.25 + 0.5)),
                    "cores": cores if cores is not None else 1,
                }
            ],
        }
    )
    with transaction.atomic():
        lock_catalog()
        if Model.objects.filter(name=definition["name"]).exists():
            raise conflict(
                f"A model named {definition['name']} already exists; choose another name.",
                code="name_taken",
            )
        catalog = catalog_snapshot()
        catalog[definition["name"]] = definition
        refuse_if_invalid(catalog, [definition["name"]])
        fetch = Fetch.objects.create(
            repo=repo,
            branch=branch,
            commit=commit,
            files=[weights.as_dict()],
            bytes_total=weights.size,
            serve_definition=definition,
            requested_by=actor.user,
            door=actor.door,
        )
        _kick("catalog.tasks.run_fetch", fetch.pk)
    return fetch


def finish_serve(fetch: Fetch) -> None:
    """The files are in (or not): add the model the fetch was for, as the person who asked."""
    if (
        fetch.state != Fetch.DONE
        or not fetch.serve_definition
        or Model.objects.filter(
            name=fetch.serve_definition["name"], source=fetch.serve_definition["source"]
        ).exists()
    ):
        return
    user = fetch.requested_by
    actor = Actor.for_user(user, fetch.door) if user is not None else SYSTEM
    try:
        model_add(actor=actor, definition=fetch.serve_definition, source_check=False)
    except CatalogError as exc:
        Fetch.objects.filter(pk=fetch.pk).update(
            state=Fetch.FAILED,
            message=f"the files are in the mirror, but the model was not added: {exc.message}",
        )


def _origin(model: Model) -> dict[str, Any]:
    """The origin of a model the check looks at (only those with one are)."""
    assert model.origin is not None
    return model.origin


# -- the check --------------------------------------------------------------------


@dataclass
class CheckReport:
    requests: int = 0
    repositories: int = 0
    updates: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)


def check_updates(
    *, actor: Actor | None = None, registry: Registry | None = None, now: datetime | None = None
) -> CheckReport:
    """Ask the registry, once per repository, whether the files of served models changed.

    Beat asks about every served model every `mirror.update_check` (no actor). Asked by a
    person, staff ask about every model and anyone else about the models they own: each
    repository asked about is a registry request made with the installation's token, which
    the registry may rate-limit for everyone.
    """
    registry = registry or Registry()
    now = now or timezone.now()
    report = CheckReport()
    models = list(Model.objects.exclude(origin=None)) + _adopt_origins()
    if actor is not None and not actor.is_staff and actor.door not in ("config", "system"):
        mine = getattr(actor.user, "pk", None)
        models = [m for m in models if m.owner_id is not None and m.owner_id == mine]
    by_repo: dict[str, list[Model]] = {}
    for model in models:
        by_repo.setdefault(_origin(model)["repo"], []).append(model)
    report.repositories = len(by_repo)
    for repo, served in by_repo.items():
        try:
            heads = registry.branch_heads(repo)
        except RegistryError as exc:
            for model in served:
                model.update_check_error = f"last check failed: {exc}"
                model.update_checked_at = now
            report.failures[repo] = str(exc)
            continue
        branches: dict[str, list[Model]] = {}
        for model in served:
            branches.setdefault(_origin(model).get("branch", "main"), []).append(model)
        for branch, on_branch in branches.items():
            _check_branch(registry, repo, branch, heads.get(branch), on_branch, now, report)
    Model.objects.bulk_update(
        models,
        ["origin", "update_available", "update_checked_at", "update_check_error"],
        batch_size=500,
    )
    report.requests = registry.requests
    return report


def _adopt_origins() -> list[Model]:
    """Models added by URL before: their origin is worked out from the mirror's records."""
    adopted = []
    for model in Model.objects.filter(origin=None, source__contains="/mirror/"):
        origin = origin_for_source(model.source)
        if origin is not None:
            model.origin = origin
            adopted.append(model)
    return adopted


def _check_branch(
    registry: Registry,
    repo: str,
    branch: str,
    head: str | None,
    served: list[Model],
    now: datetime,
    report: CheckReport,
) -> None:
    if head is None:
        for model in served:
            model.update_check_error = (
                f"last check failed: {repo} has no branch {branch!r} any more"
            )
            model.update_checked_at = now
        return
    # Models already known to be current, or to have this update, at this head need no second request.
    moved = [
        m
        for m in served
        if head
        not in (
            _origin(m)["commit"],
            _origin(m).get("checked_commit"),
            (m.update_available or {}).get("commit"),
        )
    ]
    for model in served:
        model.update_check_error = ""
        model.update_checked_at = now
        if model not in moved and _origin(model)["commit"] == head:
            model.update_available = None
    if not moved:
        return
    paths = sorted({f["path"] for m in moved for f in _origin(m)["files"]})
    try:
        current = {f.path: f for f in registry.paths(repo, head, paths)}
    except RegistryError as exc:
        for model in moved:
            model.update_check_error = f"last check failed: {exc}"
        report.failures[repo] = str(exc)
        return
    for model in moved:
        changed = []
        for served_file in _origin(model)["files"]:
            new = current.get(served_file["path"])
            if new is None:
                model.update_check_error = (
                    f"{served_file['path']} is gone from {repo} at {head[:7]}"
                )
                continue
            if new.sha256 != served_file["sha256"]:
                changed.append(new.as_dict())
        if changed:
            model.update_available = {
                "commit": head,
                "files": changed,
                "bytes": sum(f["size"] for f in changed),
                "checked_at": now.isoformat(),
            }
            report.updates.append(model.name)
        else:
            # The branch moved, but not the files this model serves: not an update.
            model.origin = {**(model.origin or {}), "checked_commit": head}
            model.update_available = None


# -- update and rollback ----------------------------------------------------------


def _refuse_if_rolling(model: Model) -> None:
    active = Rollout.objects.filter(model=model, state__in=Rollout.ACTIVE).first()
    if active is not None:
        raise conflict(
            f"An {active.kind} of {model.name} is already under way (asked by {active.actor_name}, "
            f"{active.state}); wait for it, or follow it with `llmgw ctl model {active.kind} {model.name} --wait`.",
            code="rollout_in_progress",
        )


def start_update(*, actor: Actor, name: str) -> Rollout:
    """Fetch the newer files beside the old ones; the swap and the replacement follow by themselves."""
    with transaction.atomic():
        lock_catalog()
        model = get_model(name)
        require_change_rights(actor, model)
        refuse_if_declared(
            model, "an update made here would revert then (its source is in the file)"
        )
        _refuse_if_rolling(model)
        if not model.origin:
            raise CatalogError(
                f"{model.name} was not served from the registry, so there is nothing to update it from. "
                "Use `llmgw ctl model serve REPO` for a model that follows the registry.",
                code="no_origin",
            )
        update = model.update_available
        if not update:
            raise CatalogError(
                f"No newer weights are known for {model.name} (on {model.origin['commit'][:7]}). "
                "Run `llmgw ctl model updates --check` to ask the registry now.",
                code="no_update",
            )
        repo, new_commit = model.origin["repo"], update["commit"]
        changed = {f["path"]: f for f in update["files"]}
        files = [changed.get(f["path"], f) for f in model.origin["files"]]
        in_mirror = parse_mirror_url(model.source)
        weights_path = in_mirror[2] if in_mirror else files[0]["path"]
        fetch = Fetch.objects.create(
            repo=repo,
            branch=model.origin.get("branch", "main"),
            commit=new_commit,
            files=files,
            bytes_total=sum(f["size"] for f in files),
            requested_by=actor.user,
            door=actor.door,
        )
        rollout = Rollout.objects.create(
            model=model,
            kind="update",
            state=Rollout.FETCHING,
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
        )
        _kick("catalog.tasks.run_fetch", fetch.pk)
    return rollout


def start_rollback(*, actor: Actor, name: str) -> Rollout:
    """Go back to the previous files (kept in the mirror); an update under way is stopped."""
    with transaction.atomic():
        lock_catalog()
        model = get_model(name)
        require_change_rights(actor, model)
        refuse_if_declared(
            model, "a rollback made here would revert then (its source is in the file)"
        )
        if not model.previous:
            raise CatalogError(
                f"{model.name} has no previous weights to go back to: it was never updated.",
                code="no_previous",
            )
        for active in Rollout.objects.filter(model=model, state__in=Rollout.ACTIVE):
            active.state, active.finished_at = Rollout.FAILED, timezone.now()
            active.message = f"stopped by a rollback asked for by {actor.name}"
            active.save(update_fields=["state", "finished_at", "message"])
        current_commit = (model.origin or {}).get("commit", "")
        target = model.previous
        rollout = Rollout.objects.create(
            model=model,
            kind="rollback",
            state=Rollout.ROLLING,
            from_commit=current_commit,
            to_commit=(target.get("origin") or {}).get("commit", ""),
            from_source=model.source,
            to_source=target["source"],
            step="replacing replicas",
            requested_by=actor.user,
            actor_name=actor.name,
            door=actor.door,
        )
        _swap(model, target["source"], target.get("sha256", ""), target.get("origin"))
        record_change(
            actor,
            model.name,
            "rollback",
            {"commit": current_commit, "source": rollout.from_source},
            {"commit": rollout.to_commit, "source": rollout.to_source},
            note=f"rollback: {current_commit[:7]} -> {rollout.to_commit[:7]}",
        )
        announce(model.name)
    return rollout


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
    for rollout in Rollout.objects.filter(state__in=Rollout.ACTIVE).select_related(
        "model", "fetch"
    ):
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
        _finish(rollout, Rollout.FAILED, "the fetch of the new files disappeared")
        return
    if fetch.state == Fetch.FAILED:
        _finish(rollout, Rollout.FAILED, f"refused, the model is unchanged: {fetch.message}")
        return
    if fetch.state != Fetch.DONE:
        from .mirror import STALE_SECONDS

        stale = (
            fetch.heartbeat_at is None
            or (timezone.now() - fetch.heartbeat_at).total_seconds() > STALE_SECONDS
        )
        if fetch.state == Fetch.QUEUED or stale:
            _kick_now("catalog.tasks.run_fetch", fetch.pk)  # resumes an interrupted fetch
        done = f"{fetch.bytes_done / 1e6:.1f} of {fetch.bytes_total / 1e6:.1f} MB"
        Rollout.objects.filter(pk=rollout.pk).update(
            step=f"fetching the new files into the mirror: {done}"
        )
        return
    with transaction.atomic():
        lock_catalog()
        model = Model.objects.select_related("owner").get(pk=rollout.model_id)
        if Rollout.objects.get(pk=rollout.pk).state != Rollout.FETCHING:
            return  # another worker took this step
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
        _swap(model, rollout.to_source, weights.get("sha256") or "", origin)
        rollout.state, rollout.step = Rollout.ROLLING, "replacing replicas"
        rollout.save(update_fields=["state", "step"])
        record_change(
            _actor_of(rollout),
            model.name,
            "update-swap",
            {"source": rollout.from_source},
            {"source": rollout.to_source},
            note=f"new files fetched and checked; replicas move to {fetch.commit[:7]} one at a time",
        )
        announce(model.name)


def _advance_rolling(rollout: Rollout) -> None:
    from fleet.models import Replica
    from fleet.reconciler import desired_count
    from fleet.specs import current_keys

    from .config import current_config

    model = rollout.model
    if model.rollout_halted:
        _finish(
            rollout,
            Rollout.HALTED,
            f"{model.rollout_halted}. The old replicas keep serving; a rollback goes back.",
        )
        return
    keys = current_keys(model)
    active = list(Replica.objects.filter(model=model, withdrawn_at__isnull=True))
    fresh_ready = [
        r for r in active if r.spec_key == keys.get(r.profile) and r.state == Replica.READY
    ]
    stale = [r for r in active if r.spec_key != keys.get(r.profile)]
    desired = desired_count(model, timezone.now(), current_config().default_idle_timeout)
    total = max(desired, len(fresh_ready))
    if not stale and len(fresh_ready) >= desired:
        Rollout.objects.filter(pk=rollout.pk).update(replaced=total, total=total)
        rollout.replaced, rollout.total = total, total
        _finish(
            rollout, Rollout.DONE, f"every replica runs {rollout.to_commit[:7] or 'the new files'}"
        )
        return
    waiting = [r for r in active if r.spec_key == keys.get(r.profile) and r.state != Replica.READY]
    step = f"replaced {len(fresh_ready)} of {total}"
    if waiting:
        step += f"; a new replica is {waiting[0].state}"
    Rollout.objects.filter(pk=rollout.pk).update(replaced=len(fresh_ready), total=total, step=step)


def _finish(rollout: Rollout, state: str, message: str) -> None:
    with transaction.atomic():
        updated = Rollout.objects.filter(pk=rollout.pk, state__in=Rollout.ACTIVE).update(
            state=state, message=message, step=message, finished_at=timezone.now()
        )
        if not updated:
            return
        AuditEntry.objects.create(
            actor=None,
            actor_name=SYSTEM.name,
            door=SYSTEM.door,
            model_name=rollout.model.name,
            action=f"{rollout.kind}-{state}",
            note=message,
            changes={},
        )
    if state == Rollout.DONE:
        from .mirror import clean_mirror

        clean_mirror()

"""Serve a repository's weights, and notice newer ones (the update check).

Moving a model to the newer weights, and back, is registry.rollouts.
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

from catalog.definitions import MAX_FILES, clean_definition
from catalog.models import Model
from catalog.services import catalog_snapshot, lock_catalog, model_add, refuse_if_invalid
from core.actor import SYSTEM, Actor
from core.refusals import Refused, conflict
from llmgw.engines import DEFAULT_ENGINE, Engine, get_engine

from .hub import (
    Registry,
    RegistryError,
    RegistryFile,
    UnknownBranch,
    UnknownRepository,
    match_files,
)
from .mirror import file_url, origin_for_source, refuse_past_mirror_room
from .models import Fetch
from .queue import queue_on_commit
from .quota import file_key, refuse_past_serve_quota

log = logging.getLogger("registry.updates")

# The file a GGUF model is served from when no pattern is given: the repository's only GGUF
# file (a projector beside it not counted).
GGUF_PATTERN = "*.gguf"


# -- serve ------------------------------------------------------------------------


def _default_name(path: str) -> str:
    stem = path.rsplit("/", 1)[-1].removesuffix(".gguf").lower()
    return re.sub(r"[^a-z0-9._:-]+", "-", stem).strip("-")[:100] or "model"


def serve_start(
    *,
    actor: Actor,
    repo: str,
    pattern: str | None = None,
    branch: str = "main",
    name: str | None = None,
    mmproj: str = "",
    memory_gb: float | None = None,
    cores: float | None = None,
    min_replicas: int = 1,
    max_replicas: int | None = None,
    engine: str = "",
) -> Fetch:
    """Start fetching one GGUF file of a repository into the mirror, and its vision projector
    (`mmproj`, a path in the repository) when given; or, for an engine that loads a snapshot,
    the repository's files that `pattern` names (its default set when not given). The model is
    added when they are in."""
    backend = get_engine(engine or DEFAULT_ENGINE)
    if backend.weights_layout == "snapshot":
        if mmproj:
            raise Refused(
                f"{backend.name} takes no separate projector file (a vision model's snapshot "
                "holds its own): leave mmproj out.",
                code="invalid",
            )
        commit, files = _snapshot_files(repo, pattern, branch, backend)
    else:
        commit, weights = _one_gguf_file(repo, pattern or GGUF_PATTERN, branch, besides=mmproj)
        files = [weights] + ([_projector_file(repo, commit, mmproj)] if mmproj else [])
    definition = _serve_definition(
        repo,
        branch,
        commit,
        files,
        name=name,
        memory_gb=memory_gb,
        cores=cores,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        engine=engine,
        mmproj=bool(mmproj),
    )
    # Before the catalog's lock, which is a write: on a full disk the refusal gives the figures.
    refuse_past_mirror_room(f"serve {repo}", repo, [f.as_dict() for f in files])
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
        refuse_past_serve_quota(
            actor,
            f"serve {repo}",
            {file_key(repo, commit, f.as_dict()): f.size for f in files},
        )
        fetch = Fetch.objects.create(
            repo=repo,
            branch=branch,
            commit=commit,
            files=[f.as_dict() for f in files],
            bytes_total=sum(f.size for f in files),
            serve_definition=definition,
            requested_by=actor.user,
            door=actor.door,
        )
        queue_on_commit("registry.tasks.run_fetch", fetch.pk)
    return fetch


def _one_gguf_file(
    repo: str, pattern: str, branch: str, *, besides: str = ""
) -> tuple[str, RegistryFile]:
    """The branch's head commit and the one GGUF file of it that `pattern` names, the vision
    projector (`besides`) not counted: "*.gguf" names the weights of a repository with both."""
    commit, listing = _listing(repo, branch)
    matches = [
        f for f in match_files(listing, pattern) if f.path.endswith(".gguf") and f.path != besides
    ]
    if not matches:
        raise Refused(
            f"{repo} has no GGUF file matching {pattern!r} on {branch} ({commit[:7]}). "
            "Name the file with a pattern (a glob such as '*q4_k_m.gguf').",
            code="no_match",
        )
    if len(matches) > 1:
        names = ", ".join(f.path for f in matches[:10])
        raise Refused(
            f"{len(matches)} GGUF files of {repo} match {pattern!r}: {names}. A model serves one; "
            "narrow the file pattern.",
            code="ambiguous",
        )
    return commit, matches[0]


def _listing(repo: str, branch: str) -> tuple[str, list[RegistryFile]]:
    """The branch's head commit and its files, or the refusal that says why not."""
    registry = Registry()
    try:
        commit = registry.branch_head(repo, branch)
        return commit, registry.files(repo, commit)
    except UnknownBranch as exc:
        raise Refused(f"Cannot serve {repo}: {exc}.", code="unknown_branch") from None
    except UnknownRepository as exc:
        raise Refused(
            f"Cannot serve {repo}: {exc}. Check the name (ORG/NAME, as on the registry).",
            code="unknown_repository",
            status=404,
        ) from None
    except RegistryError as exc:
        raise Refused(
            f"Cannot serve {repo}: {exc}. Check that the registry is up and try again.",
            code="registry_error",
            status=502,
        ) from None


def _snapshot_files(
    repo: str, pattern: str | None, branch: str, engine: Engine
) -> tuple[str, list[RegistryFile]]:
    """The head commit and the files of a snapshot: those any of the globs in `pattern` (comma
    separated; the engine's set when not given) names, its entry (config.json) first."""
    commit, listing = _listing(repo, branch)
    globs = [g.strip() for g in (pattern or ",".join(engine.snapshot_patterns)).split(",")]
    picked = {f.path: f for glob in globs if glob for f in match_files(listing, glob)}
    entry = picked.pop(engine.snapshot_entry, None)
    weights = [p for p in picked if p.endswith(engine.weights_suffix)]
    if entry is None or not weights:
        missing = engine.snapshot_entry if entry is None else f"a {engine.weights_suffix} file"
        raise Refused(
            f"{repo} at {commit[:7]} ({branch}) has no {missing} among the files "
            f"{', '.join(globs)} name: {engine.name} loads a Hugging Face snapshot (its "
            f"{engine.snapshot_entry}, tokenizer and {engine.weights_suffix} weights). Check "
            "the repository, or name its files with a pattern (globs separated by commas).",
            code="no_match",
        )
    if len(picked) + 1 > MAX_FILES:
        raise Refused(
            f"{len(picked) + 1} files of {repo} match {', '.join(globs)}; a model loads at most "
            f"{MAX_FILES}: narrow the pattern.",
            code="ambiguous",
        )
    return commit, [entry, *sorted(picked.values(), key=lambda f: f.path)]


def _projector_file(repo: str, commit: str, mmproj: str) -> RegistryFile:
    """The vision projector `mmproj` of the repository at `commit`, as the registry lists it."""
    try:
        found = {f.path: f for f in Registry().paths(repo, commit, [mmproj])}
    except RegistryError as exc:
        raise Refused(
            f"Cannot serve {repo}: {exc}. Check that the registry is up and try again.",
            code="registry_error",
            status=502,
        ) from None
    if mmproj not in found:
        raise Refused(
            f"{repo} has no file {mmproj!r} at {commit[:7]} to serve as the vision projector. "
            "Name the projector's .gguf file by its path in the repository, or leave mmproj out.",
            code="no_mmproj",
        )
    return found[mmproj]


def _serve_definition(
    repo: str,
    branch: str,
    commit: str,
    files: list[RegistryFile],
    *,
    name: str | None,
    memory_gb: float | None,
    cores: float | None,
    min_replicas: int,
    max_replicas: int | None,
    engine: str = "",
    mmproj: bool = False,
) -> dict[str, Any]:
    """The definition of the model a serve adds, its source the file's place in the mirror
    (`files`: the weights, then the vision projector when there is one; for a snapshot, its
    config.json, then its other files)."""
    weights = files[0]
    snapshot = get_engine(engine or DEFAULT_ENGINE).weights_layout == "snapshot"
    # The projector is loaded beside the weights: it counts as they do.
    size_gib = sum(f.size for f in files) / 2**30
    if snapshot:
        default_name = repo.rsplit("/", 1)[-1]
        besides: dict[str, Any] = {"engine": engine, "files": [f.path for f in files[1:]]}
        described = f"{len(files)} files"
    else:
        default_name = weights.path
        besides = {"mmproj": files[1].path} if mmproj else {}
        described = weights.path
    return clean_definition(
        {
            "name": name or _default_name(default_name),
            "source": file_url(repo, commit, weights.path),
            **besides,
            "description": f"{described} from {repo} ({branch})",
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
    except Refused as exc:
        fetch.refuse_model(
            f"the files are in the mirror, but the model was not added: {exc.message}"
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
    if actor is not None and not (actor.is_staff or actor.is_installation):
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
        origin = origin_for_source(model.source, model.mmproj, model.files)
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

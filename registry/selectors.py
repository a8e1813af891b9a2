"""Reads of rollouts, fetches and updates, shaped for the API, the CLI and the console."""

from __future__ import annotations

from typing import Any

from catalog.config import current_config
from catalog.models import Model
from catalog.selectors import model_view
from fleet.selectors import model_status

from .models import Fetch, Rollout


def model_answers(models: list[Model]) -> list[dict[str, Any]]:
    """Each model as the API answers with it: the catalog's view of it, its replicas and its
    latest rollout, in three queries whatever the number of models."""
    config = current_config()
    status = model_status(models)
    rollouts = latest_rollouts(models)
    return [
        model_view(m, config, status[m.pk], rollout_view_or_none(rollouts.get(m.pk)))
        for m in models
    ]


def latest_rollouts(models: list[Model]) -> dict[int, Rollout]:
    """Each model's latest rollout, in one query."""
    latest: dict[int, Rollout] = {}
    for rollout in Rollout.objects.filter(model__in=models).order_by(
        "model_id", "-created_at", "-id"
    ):
        latest.setdefault(rollout.model_id, rollout)
    return latest


def rollout_view(rollout: Rollout) -> dict[str, Any]:
    return {
        "id": rollout.pk,
        "kind": rollout.kind,
        "state": rollout.state,
        "from_commit": rollout.from_commit,
        "to_commit": rollout.to_commit,
        "from_source": rollout.from_source,
        "to_source": rollout.to_source,
        "replaced": rollout.replaced,
        "total": rollout.total,
        "step": rollout.step,
        "message": rollout.message,
        "asked_by": rollout.actor_name,
        "fetch": (
            {"bytes_done": rollout.fetch.bytes_done, "bytes_total": rollout.fetch.bytes_total}
            if rollout.fetch_id and rollout.fetch
            else None
        ),
        "started_at": rollout.created_at.isoformat(),
        "finished_at": rollout.finished_at.isoformat() if rollout.finished_at else None,
    }


def rollout_view_or_none(rollout: Rollout | None) -> dict[str, Any] | None:
    return rollout_view(rollout) if rollout is not None else None


def fetch_view(fetch: Fetch) -> dict[str, Any]:
    model = (fetch.serve_definition or {}).get("name")
    return {
        "id": fetch.pk,
        "repo": fetch.repo,
        "branch": fetch.branch,
        "commit": fetch.commit,
        "files": [{"path": f["path"], "size": f["size"]} for f in fetch.files],
        "state": fetch.state,
        "bytes_done": fetch.bytes_done,
        "bytes_total": fetch.bytes_total,
        "message": fetch.message,
        "model": model,
        "model_added": bool(
            model and fetch.state == Fetch.DONE and Model.objects.filter(name=model).exists()
        ),
    }


def update_view(model: Model) -> dict[str, Any]:
    update = model.update_available or {}
    return {
        "model": model.name,
        "repo": (model.origin or {}).get("repo"),
        "current_commit": (model.origin or {}).get("commit"),
        "new_commit": update.get("commit"),
        "files": update.get("files", []),
        "bytes": update.get("bytes"),
        "checked_at": model.update_checked_at.isoformat() if model.update_checked_at else None,
        "error": model.update_check_error or None,
        "rolled_back_from": update.get("rolled_back_from"),
    }

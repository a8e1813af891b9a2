"""Reads of the catalog, shaped for the API, the CLI and the console."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from core.durations import format_duration

from .config import ClusterConfig
from .models import AuditEntry, Model


def model_queryset() -> QuerySet[Model]:
    return Model.objects.select_related("owner").order_by("name")


def scaling_in_force(model: Model, config: ClusterConfig) -> dict[str, Any]:
    return {
        "min": model.min_replicas,
        "max": model.effective_max,
        "max_follows_min": model.max_replicas is None,
        "on_demand": model.on_demand,
        "parked": model.parked,
        "idle_timeout": format_duration(model.idle_timeout_in_force(config.default_idle_timeout)),
    }


def autoscale_view(model: Model) -> dict[str, Any] | None:
    """A model's autoscale policy and what the autoscaler last decided; None without one."""
    if not model.autoscale:
        return None
    state = model.autoscale_state or {}
    view: dict[str, Any] = {k: format_duration(v) for k, v in model.autoscale.items()}
    view.update(
        replicas=state.get("replicas"),
        why=state.get("why", "no decision yet: the next reconcile pass reads the gateways' waits"),
        changed_at=state.get("changed_at"),
        figures=state.get("figures"),
    )
    return view


def model_view(
    model: Model,
    config: ClusterConfig,
    status: dict[str, int] | None = None,
    rollout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One model as the API shows it: its definition, what is in force, its replicas and revisions.

    `status` (ready, replicas, desired) comes from the fleet and `rollout`, the latest update or
    rollback as registry.selectors.rollout_view shows it, from the registry: the answer with all
    of them is registry.selectors.model_answers.
    """
    view = {
        "name": model.name,
        "kind": "declared" if model.declared else "runtime",
        "owner": model.owner.username if model.owner else None,
        "class": model.class_in_force,
        "class_set": model.model_class or "default",
        "scaling": scaling_in_force(model, config),
        "source_size": model.source_size,
        "generation": model.generation,
        "engine": model.engine_name,
        "definition": model.definition(),
        "created_at": model.created_at.isoformat(),
        "updated_at": model.updated_at.isoformat(),
        "rollout_halted": model.rollout_halted or None,
        "origin": model.origin,
        "update": model.update_available,
        "update_check_error": model.update_check_error or None,
        "previous": (
            {
                "source": model.previous["source"],
                "commit": (model.previous.get("origin") or {}).get("commit"),
            }
            if model.previous
            else None
        ),
        "rollout": rollout,
        "autoscale": autoscale_view(model),
    }
    if status is not None:
        view.update(status)
    return view


def audit_queryset(
    *, model: str | None = None, actor: str | None = None, action: str | None = None
) -> QuerySet[AuditEntry]:
    entries = AuditEntry.objects.all()
    if model:
        entries = entries.filter(model_name=model)
    if actor:
        entries = entries.filter(actor_name=actor)
    if action:
        entries = entries.filter(action=action)
    return entries.order_by("-at", "-id")


def audit_view(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry.pk,
        "at": entry.at.isoformat(),
        "actor": entry.actor_name,
        "door": entry.door,
        "model": entry.model_name,
        "action": entry.action,
        "changes": entry.changes,
        "before": entry.before,
        "after": entry.after,
        "note": entry.note,
        "trace_id": entry.trace_id,
    }

"""Reads shaped for the console's pages: filtered, paginated, in a fixed number of queries.

The API's selectors give each model's view; what is here is what only a page
needs on top of them: filters, pages, where each replica runs, bars for nodes.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.core.paginator import Page, Paginator
from django.db.models import Count, F, IntegerField, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from catalog import selectors as catalog_selectors
from catalog.config import current_config
from catalog.models import CLASS_CHOICES, AuditEntry, Model, Rollout
from fleet.models import Replica
from fleet.reconciler import desired_count

MODELS_PER_PAGE = 50
AUDIT_PER_PAGE = 50

CLASSES = [value for value, _ in CLASS_CHOICES]
# The state filter, in the words the list uses. "Wanted" is the replica count
# the reconciler aims for now; an on-demand model wants at most one, so one
# ready replica is all it needs to be ready.
STATES = {
    "ready": "ready: every wanted replica is ready",
    "degraded": "degraded: some replicas ready, fewer than wanted",
    "not-running": "not running: no replica ready",
}


def can_change(user: Any, model: Model) -> bool:
    """The services' rule, so that nobody is shown a button that would only be refused."""
    return bool(user.is_staff or (model.owner_id is not None and model.owner_id == user.pk))


@dataclass(frozen=True)
class Registry:
    """What the registry part of a row shows; every key may be absent until updates exist."""

    origin: dict[str, Any] | None = None
    update: dict[str, Any] | None = None
    previous: dict[str, Any] | None = None
    rollout: dict[str, Any] | None = None
    check_error: str | None = None

    @classmethod
    def of(cls, view: dict[str, Any]) -> Registry:
        return cls(
            origin=view.get("origin"),
            update=view.get("update"),
            previous=view.get("previous"),
            rollout=view.get("rollout"),
            check_error=view.get("update_check_error"),
        )

    @property
    def rollout_active(self) -> bool:
        return bool(self.rollout and self.rollout.get("state") in Rollout.ACTIVE)

    @property
    def rollout_percent(self) -> int:
        if not self.rollout or not self.rollout.get("total"):
            return 0
        return min(100, round(100 * (self.rollout.get("replaced") or 0) / self.rollout["total"]))

    @property
    def shown(self) -> bool:
        return any((self.origin, self.update, self.previous, self.rollout))


@dataclass
class ModelRow:
    view: dict[str, Any]
    state: str
    placements: list[tuple[str, str, int]]  # (node, replica state, how many)
    can_change: bool
    registry: Registry = field(default_factory=Registry)


def model_state(ready: int, desired: int) -> str:
    if ready == 0:
        return "not-running"
    return "ready" if ready >= desired else "degraded"


def _ready_count() -> Subquery:
    return Subquery(
        Replica.objects.filter(model=OuterRef("pk"), withdrawn_at__isnull=True, state=Replica.READY)
        .order_by()
        .values("model")
        .annotate(n=Count("pk"))
        .values("n"),
        output_field=IntegerField(),
    )


def filter_models(
    *, owner: str = "", klass: str = "", state: str = "", search: str = ""
) -> QuerySet[Model]:
    """The models matching the list's filters, filtered in the database so that pages stay cheap."""
    models = catalog_selectors.model_queryset()
    if owner:
        models = models.filter(owner__username=owner)
    on_demand = Q(min_replicas=0, max_replicas__gt=0)
    if klass == "critical":
        models = models.filter(model_class="critical")
    elif klass == "opportunistic":
        models = models.filter(Q(model_class="opportunistic") | (Q(model_class="") & on_demand))
    elif klass == "standard":
        models = models.filter(Q(model_class="standard") | (Q(model_class="") & ~on_demand))
    if search:
        models = models.filter(name__icontains=search)
    if state in STATES:
        # The wanted count is min_replicas, except for a model with min 0, which
        # wants at most one: so one ready replica makes it ready (see STATES).
        models = models.annotate(ready_now=Coalesce(_ready_count(), Value(0)))
        if state == "not-running":
            models = models.filter(ready_now=0)
        elif state == "degraded":
            models = models.filter(ready_now__gt=0, ready_now__lt=F("min_replicas"))
        else:
            models = models.filter(ready_now__gt=0, ready_now__gte=F("min_replicas"))
    return models


def model_rows(models: list[Model], user: Any) -> list[ModelRow]:
    """Rows for these models (one page of them): one query for their replicas, one for rollouts."""
    config = current_config()
    now = timezone.now()
    placed: dict[int, Counter[tuple[str, str]]] = defaultdict(Counter)
    for model_id, node_name, replica_state in (
        Replica.objects.filter(model__in=[m.pk for m in models], withdrawn_at__isnull=True)
        .order_by("node__name")
        .values_list("model_id", "node__name", "state")
    ):
        placed[model_id][(node_name, replica_state)] += 1
    rollouts = catalog_selectors.latest_rollouts(models)
    rows = []
    for model in models:
        counts = placed.get(model.pk, Counter())
        ready = sum(n for (_, s), n in counts.items() if s == Replica.READY)
        desired = desired_count(model, now, config.default_idle_timeout)
        status = {"ready": ready, "replicas": sum(counts.values()), "desired": desired}
        view = catalog_selectors.model_view(model, config, status, rollouts.get(model.pk))
        rows.append(
            ModelRow(
                view=view,
                state=model_state(ready, desired),
                placements=[(node, s, n) for (node, s), n in counts.items()],
                can_change=can_change(user, model),
                registry=Registry.of(view),
            )
        )
    return rows


def owners() -> list[str]:
    """The usernames that own at least one model, for the owner filter."""
    return list(
        get_user_model()
        .objects.filter(owned_models__isnull=False)
        .order_by("username")
        .values_list("username", flat=True)
        .distinct()
    )


def page_of(items: Any, number: Any, per_page: int) -> Page:
    """A page; a number out of range gives the nearest page rather than an error."""
    return Paginator(items, per_page).get_page(number)


# -- nodes ------------------------------------------------------------------------


def _percent(part: float, whole: float) -> int:
    if whole <= 0:
        return 100 if part > 0 else 0
    return max(0, min(100, round(100 * part / whole)))


def node_cards(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fleet.selectors.nodes_view() with what the bars and lists need."""
    cards = []
    for node in nodes:
        capacity, reserved = node["capacity"], node["reserved"]
        heartbeat = node["last_heartbeat"]
        bars = [
            {
                "label": "Memory",
                "unit": "GB",
                "capacity": capacity["memory_gb"],
                "reserved": reserved["memory_gb"],
                "free": node["free"]["memory_gb"],
                "percent": _percent(reserved["memory_gb"], capacity["memory_gb"]),
            },
            {
                "label": "Cores",
                "unit": "",
                "capacity": capacity["cores"],
                "reserved": reserved["cores"],
                "free": node["free"]["cores"],
                "percent": _percent(reserved["cores"], capacity["cores"]),
            },
        ]
        if capacity["gpus"]:
            bars.append(
                {
                    "label": "GPUs",
                    "unit": "",
                    "capacity": capacity["gpus"],
                    "reserved": reserved["gpus"],
                    "free": node["free"]["gpus"],
                    "percent": _percent(reserved["gpus"], capacity["gpus"]),
                }
            )
        cards.append(
            {
                **node,
                "bars": bars,
                "replica_counts": sorted(Counter(node["replicas"]).items()),
                "heartbeat_at": datetime.fromisoformat(heartbeat) if heartbeat else None,
                "cordoned": node["state"] == "cordoned",
            }
        )
    return cards


# -- audit ------------------------------------------------------------------------


def audit_actions() -> list[str]:
    return list(AuditEntry.objects.order_by("action").values_list("action", flat=True).distinct())


def _shown(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(", ", ": "))


def audit_rows(entries: list[AuditEntry]) -> list[dict[str, Any]]:
    rows = []
    for entry in entries:
        view = catalog_selectors.audit_view(entry)
        view["at"] = entry.at
        view["door_label"] = entry.get_door_display()
        view["change_list"] = [
            (key, _shown(old), _shown(new)) for key, (old, new) in (entry.changes or {}).items()
        ]
        rows.append(view)
    return rows

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
from django.db.models import Count, F, IntegerField, Max, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.urls import reverse
from django.utils import timezone

from access.services import KEY_SUBJECT, TEAM_SUBJECT
from catalog import selectors as catalog_selectors
from catalog.config import current_config
from catalog.models import CLASS_CHOICES, ON_DEMAND, AuditEntry, Model
from core.durations import format_duration
from fleet.models import Node, Replica
from fleet.selectors import model_target as fleet_target
from fleet.selectors import node_engine_numbers
from llmgw.units import format_progress, format_size
from registry import selectors as registry_selectors
from registry.models import Fetch, MirrorFile, Rollout

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


def size_text(size: int | None) -> str:
    """812 bytes, 501 kB, 4.1 GB (llmgw.units.format_size)."""
    return format_size(size)


def short(commit: str | None) -> str:
    """A commit as people quote it: its first seven characters."""
    return (commit or "")[:7]


def _when(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


@dataclass(frozen=True)
class Registry:
    """What the registry part of a row shows: the keys of catalog.selectors.model_view.

    `fetch` is the fetch of a rollout still bringing its files in (fetch_view), for
    its byte progress.
    """

    origin: dict[str, Any] | None = None
    update: dict[str, Any] | None = None
    previous: dict[str, Any] | None = None
    rollout: dict[str, Any] | None = None
    check_error: str | None = None
    fetch: dict[str, Any] | None = None

    @classmethod
    def of(cls, view: dict[str, Any], fetch: dict[str, Any] | None = None) -> Registry:
        return cls(
            origin=view.get("origin"),
            update=view.get("update"),
            previous=view.get("previous"),
            rollout=view.get("rollout"),
            check_error=view.get("update_check_error"),
            fetch=fetch,
        )

    @property
    def rollout_active(self) -> bool:
        return bool(self.rollout and self.rollout.get("state") in Rollout.ACTIVE)

    @property
    def update_under_way(self) -> bool:
        """The update the badge would offer is the one running now."""
        return bool(
            self.rollout_active
            and self.update
            and self.rollout
            and self.rollout.get("kind") == "update"
            and self.rollout.get("to_commit") == self.update.get("commit")
        )

    @property
    def rollout_percent(self) -> int:
        if not self.rollout or not self.rollout.get("total"):
            return 0
        return min(100, round(100 * (self.rollout.get("replaced") or 0) / self.rollout["total"]))

    @property
    def rollout_started_at(self) -> datetime | None:
        return _when((self.rollout or {}).get("started_at"))

    @property
    def fetching(self) -> bool:
        """The rollout is bringing its files into the mirror, and how far it got is known."""
        return bool(self.fetch and self.rollout and self.rollout.get("state") == Rollout.FETCHING)

    @property
    def fetch_percent(self) -> int:
        return fetch_percent(self.fetch)

    @property
    def fetch_text(self) -> str:
        return fetch_text(self.fetch)

    @property
    def update_text(self) -> str:
        """The badge, in the issue's words: "update available: a1b2c3d → e4f5a6b, 1 file, 4.1 GB"."""
        if not self.update:
            return ""
        files = self.update.get("files") or []
        size = self.update.get("bytes")
        if size is None:
            size = sum(f.get("size") or 0 for f in files)
        count = f"{len(files)} file{'' if len(files) == 1 else 's'}"
        current = short((self.origin or {}).get("commit")) or "?"
        return f"update available: {current} → {short(self.update.get('commit'))}, {count}, {size_text(size)}"

    @property
    def rollback_target(self) -> str:
        """What Roll back returns to, in a few words."""
        if not self.previous:
            return ""
        commit = short(self.previous.get("commit"))
        return commit or "the previous files"

    @property
    def what_to_do(self) -> str:
        """For a rollout that stopped short: what still serves, and the ways on."""
        if not self.rollout:
            return ""
        state = self.rollout.get("state")
        before = short(self.rollout.get("from_commit")) or "the files before"
        if state == Rollout.HALTED:
            # The model already points at the new files: the reconciler replaces
            # again once its spec changes (a fix), and a rollback swaps back.
            return (
                f"The old replicas keep serving. Roll back to return to {before}, or fix the "
                "model (the replicas' messages say why the new ones fail) and its replicas are "
                "replaced again."
            )
        if state == Rollout.FAILED:
            return (
                f"Nothing changed: the model keeps serving {before}. Update again once the "
                "registry's files are right; Check for updates now asks it."
            )
        return ""

    @property
    def shown(self) -> bool:
        return any((self.origin, self.update, self.previous, self.rollout))


def fetch_percent(fetch: dict[str, Any] | None) -> int:
    if not fetch:
        return 0
    if fetch.get("state") == Fetch.DONE:
        return 100
    total = fetch.get("bytes_total") or 0
    return _percent(fetch.get("bytes_done") or 0, total) if total else 0


def fetch_text(fetch: dict[str, Any] | None) -> str:
    """ "0.2 of 0.5 MB" in the unit of the total, so that the two numbers compare at a glance."""
    if not fetch:
        return ""
    total = fetch.get("bytes_total") or 0
    done = total if fetch.get("state") == Fetch.DONE else (fetch.get("bytes_done") or 0)
    return format_progress(done, total)


@dataclass
class ModelRow:
    view: dict[str, Any]
    state: str
    placements: list[tuple[str, str, int]]  # (node, replica state, how many)
    can_change: bool
    registry: Registry = field(default_factory=Registry)
    traffic: str = ""  # the last hour's requests as a sparkline (console.traffic), on the list


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
    if klass == "critical":
        models = models.filter(model_class="critical")
    elif klass == "opportunistic":
        models = models.filter(Q(model_class="opportunistic") | (Q(model_class="") & ON_DEMAND))
    elif klass == "standard":
        models = models.filter(Q(model_class="standard") | (Q(model_class="") & ~ON_DEMAND))
    if search:
        models = models.filter(name__icontains=search)
    if state in STATES:
        # model_state in SQL: with a replica ready, Model.desired_replicas is min_replicas, or
        # at most one for a model with min 0, which one ready replica meets (see STATES).
        models = models.annotate(ready_now=Coalesce(_ready_count(), Value(0)))
        if state == "not-running":
            models = models.filter(ready_now=0)
        elif state == "degraded":
            models = models.filter(ready_now__gt=0, ready_now__lt=F("min_replicas"))
        else:
            models = models.filter(ready_now__gt=0, ready_now__gte=F("min_replicas"))
    return models


def model_rows(models: list[Model], user: Any) -> list[ModelRow]:
    """Rows for these models (one page of them): a query each for replicas, rollouts and fetches."""
    config = current_config()
    now = timezone.now()
    placed: dict[int, Counter[tuple[str, str]]] = defaultdict(Counter)
    for model_id, node_name, replica_state in (
        Replica.objects.filter(model__in=[m.pk for m in models], withdrawn_at__isnull=True)
        .order_by("node__name")
        .values_list("model_id", "node__name", "state")
    ):
        placed[model_id][(node_name, replica_state)] += 1
    rollouts = registry_selectors.latest_rollouts(models)
    fetching = [r.fetch_id for r in rollouts.values() if r.state == Rollout.FETCHING and r.fetch_id]
    fetches = {
        fetch.pk: registry_selectors.fetch_view(fetch)
        for fetch in (Fetch.objects.filter(pk__in=fetching) if fetching else [])
    }
    rows = []
    for model in models:
        counts = placed.get(model.pk, Counter())
        ready = sum(n for (_, s), n in counts.items() if s == Replica.READY)
        desired = model.desired_replicas(now, config.default_idle_timeout)
        status = {"ready": ready, "replicas": sum(counts.values()), "desired": desired}
        rollout = rollouts.get(model.pk)
        view = catalog_selectors.model_view(
            model, config, status, registry_selectors.rollout_view_or_none(rollout)
        )
        fetch = fetches.get(rollout.fetch_id) if rollout and rollout.fetch_id else None
        rows.append(
            ModelRow(
                view=view,
                state=model_state(ready, desired),
                placements=[(node, s, n) for (node, s), n in counts.items()],
                can_change=model.may_be_changed_by(user),
                registry=Registry.of(view, fetch),
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


# How long after a fetch is done its model may take to appear before the page stops
# waiting: the worker adds it right after the last byte, so this only ends the wait for a
# model that was removed since.
MODEL_ADD_GRACE_SECONDS = 60


def fetch_progress(fetch: Fetch) -> dict[str, Any]:
    """A fetch as its progress card shows it (fetch_view), and whether the card asks again."""
    view = registry_selectors.fetch_view(fetch)
    waiting_for_model = (
        view["state"] == Fetch.DONE
        and bool(view["model"])
        and not view["model_added"]
        and (
            fetch.finished_at is None
            or (timezone.now() - fetch.finished_at).total_seconds() < MODEL_ADD_GRACE_SECONDS
        )
    )
    return {
        "fetch": view,
        "percent": fetch_percent(view),
        "progress": fetch_text(view),
        "files": [{**f, "size_text": size_text(f["size"])} for f in view["files"]],
        "polling": view["state"] in (Fetch.QUEUED, Fetch.RUNNING) or waiting_for_model,
        "waiting_for_model": waiting_for_model,
    }


# -- where a model's weights came from -------------------------------------------


def _file_rows(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "path": f.get("path", ""),
            "size": size_text(f.get("size")),
            "sha256": f.get("sha256") or "",
            "sha256_short": (f.get("sha256") or "")[:12],
        }
        for f in files
    ]


def registry_details(model: Model) -> dict[str, Any]:
    """The model page's account of its registry revisions: origin, previous, update, last check."""
    details: dict[str, Any] = {
        "origin": None,
        "previous": None,
        "update": None,
        "checked_at": model.update_checked_at,
        "check_error": model.update_check_error,
        "check_every": format_duration(current_config().update_check),
    }
    origin = model.origin
    if origin:
        paths = [f["path"] for f in origin.get("files", [])]
        fetched_at = MirrorFile.objects.filter(
            repo=origin["repo"], commit=origin["commit"], path__in=paths
        ).aggregate(at=Max("fetched_at"))["at"]
        details["origin"] = {
            "repo": origin["repo"],
            "branch": origin.get("branch", "main"),
            "commit": origin["commit"],
            "short": short(origin["commit"]),
            "fetched_at": fetched_at,
            "files": _file_rows(origin.get("files", [])),
        }
    previous = model.previous
    if previous:
        before = previous.get("origin") or {}
        details["previous"] = {
            "source": previous.get("source", ""),
            "repo": before.get("repo"),
            "commit": before.get("commit"),
            "short": short(before.get("commit")),
            "files": _file_rows(before.get("files", [])),
        }
    update = registry_selectors.update_view(model)
    if update["new_commit"]:
        files = update["files"]
        details["update"] = {
            "commit": update["new_commit"],
            "short": short(update["new_commit"]),
            "files": _file_rows(files),
            "size": size_text(update["bytes"] or sum(f.get("size") or 0 for f in files)),
            "checked_at": _when((model.update_available or {}).get("checked_at")),
        }
    return details


# -- nodes ------------------------------------------------------------------------


def _percent(part: float, whole: float) -> int:
    if whole <= 0:
        return 100 if part > 0 else 0
    return max(0, min(100, round(100 * part / whole)))


def engine_text(numbers: dict[str, Any] | None) -> str:
    """One line on what engines report of themselves: tokens/s, busy slots, prompt cache."""
    if not numbers:
        return ""
    parts = [
        f"{numbers.get('tokens_per_second') or 0:g} tokens/s",
        f"{numbers['busy_slots']} of {numbers['slots']} slots busy",
    ]
    if numbers.get("waiting"):
        parts.append(f"{numbers['waiting']} waiting")
    if numbers.get("prompt_cache_hit_ratio") is not None:
        parts.append(f"prompt cache {numbers['prompt_cache_hit_ratio']:.0%} of prompt tokens")
    return " · ".join(parts)


def model_target(model: Model) -> dict[str, Any]:
    """fleet.selectors.model_target() with each replica's engine numbers in words."""
    target = fleet_target(model)
    for replica in target["replicas"]:
        replica["engine_text"] = engine_text(replica["engine"])
    return target


def node_cards(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fleet.selectors.nodes_view() with what the bars and lists need."""
    engines = node_engine_numbers()
    node_ids = dict(Node.objects.values_list("name", "pk"))
    cards = []
    for node in nodes:
        capacity, reserved = node["capacity"], node["reserved"]
        heartbeat = node["last_heartbeat"]
        bars = [
            {
                "label": label,
                "unit": unit,
                "capacity": capacity[field],
                "reserved": reserved[field],
                "free": node["free"][field],
                "percent": _percent(reserved[field], capacity[field]),
            }
            for field, label, unit in (("memory_gb", "Memory", "GB"), ("cores", "Cores", ""))
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
                "device_bars": [_device_bar(d) for d in node.get("devices") or []],
                "cpu_engine_only": bool(node.get("devices"))
                and all(b == "CPU" for b in node.get("engine_backends") or ["CPU"]),
                "replica_counts": sorted(Counter(node["replicas"]).items()),
                "heartbeat_at": datetime.fromisoformat(heartbeat) if heartbeat else None,
                "cordoned": node["state"] == "cordoned",
                "engines": engine_text(engines.get(node_ids.get(node["name"], -1))),
            }
        )
    return cards


def _device_bar(device: dict[str, Any]) -> dict[str, Any]:
    """A GPU's memory as a bar: llmgw's reservations, then what other programs use."""
    total = device["memory_total_gb"]
    return {
        **device,
        "reserved_percent": _percent(device["reserved_gb"], total),
        "others_percent": _percent(device["used_by_others_gb"], total),
    }


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
        view["link"] = _subject_link(entry.model_name)
        rows.append(view)
    return rows


def _subject_link(subject: str) -> str:
    """Where an audit entry's subject is shown: a model's page, or the Keys page for a gateway
    key ("key #ID"); a team ("team NAME") has no page of its own."""
    if subject.startswith(KEY_SUBJECT):
        return f"{reverse('console-keys')}#key-{subject.removeprefix(KEY_SUBJECT)}"
    if subject.startswith(TEAM_SUBJECT):
        return ""
    return reverse("console-model", args=[subject])

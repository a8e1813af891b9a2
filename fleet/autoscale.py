"""Autoscaling a model that opted into a policy: one replica up when the gateways' queue wait
stays over the policy's for its up window, one down when a replica's worth of slots stays unused
for its down window, never below the model's floor nor above its max.

The signal: every gateway process writes its fair queue's figures per model every few seconds
(`LoadSignal`, gateway.state's refresher): the waits that ended since its last write, in
WAIT_BOUNDS buckets (a request that found a slot free counts as a wait of 0), the requests
waiting now (each counted at the age it has reached), and the requests in service. `evaluate`
sums the rows written within SIGNAL_FRESH_SECONDS, whatever process or machine wrote them, so
two gateway machines count as one; a gateway with nothing asked of it writes nothing, so stale
rows count as no load, and with no row at all nothing is decided.

It runs at the start of every reconcile pass (under its lease: one at a time), and writes what
it decided and why on the model (`Model.autoscale_state`), which `Model.desired_replicas` reads.
A step is audited with the figures that caused it and counted (llmgw_autoscale_steps).

No flapping: a step needs the condition to hold for the whole window, counted from the last
step at the earliest; an up step waits for every replica of the model to be ready (a replica
still starting is capacity on its way); one step per window.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from catalog.definitions import DEFAULT_SLOTS
from catalog.models import AuditEntry, Model
from catalog.services import audit_entry
from core.actor import SYSTEM
from core.durations import format_duration
from core.metrics import control_metrics

from .models import LoadSignal, Replica

# Upper bounds (seconds) of the wait buckets a gateway counts in; the first (0) holds requests
# that did not wait at all.
WAIT_BOUNDS: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, math.inf)
# A row older than this counts for nothing (a gateway writes every traffic flush, 5 s).
SIGNAL_FRESH_SECONDS = 20
# Rows of gateways gone this long are deleted.
SIGNAL_KEEP = timedelta(hours=1)


def wait_bucket(seconds: float) -> int:
    """The WAIT_BOUNDS bucket of a wait."""
    return bisect.bisect_left(WAIT_BOUNDS, seconds) if seconds > 0 else 0


def wait_quantile(counts: list[int], q: float) -> float | None:
    """The q-quantile of the waits counted in WAIT_BOUNDS buckets, interpolated within its
    bucket; None when nothing was counted."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    lower = 0.0
    for bound, count in zip(WAIT_BOUNDS, counts, strict=False):
        if count and seen + count >= rank:
            if bound == 0.0:
                return 0.0
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - seen) / count
        seen += count
        lower = bound
    return lower


@dataclass
class Load:
    """One model's figures, summed over the fresh rows."""

    waits: list[int] = field(default_factory=lambda: [0] * len(WAIT_BOUNDS))
    waiting: int = 0
    in_service: int = 0

    def add(self, figures: Any) -> None:
        if not isinstance(figures, dict):
            return
        waits = figures.get("waits")
        if isinstance(waits, list):
            for i, count in enumerate(waits[: len(self.waits)]):
                if isinstance(count, int) and count > 0:
                    self.waits[i] += count
        for name in ("waiting", "in_service"):
            value = figures.get(name)
            if isinstance(value, int) and value > 0:
                setattr(self, name, getattr(self, name) + value)


def read_loads(now: datetime) -> dict[str, Load] | None:
    """Every model's load over the fresh rows. A gateway with nothing asked of it writes no
    row, so rows that are all stale mean no load at all; None (nothing can be decided) only
    when there is no row, not even a stale one: no gateway has run, or every one stopped."""
    rows = LoadSignal.objects.filter(at__gte=now - timedelta(seconds=SIGNAL_FRESH_SECONDS))
    loads: dict[str, Load] = {}
    fresh = False
    for figures in rows.values_list("figures", flat=True):
        fresh = True
        if not isinstance(figures, dict):
            continue
        for model, each in figures.items():
            loads.setdefault(model, Load()).add(each)
    if not fresh and not LoadSignal.objects.exists():
        return None
    return loads


_forgot_at: datetime | None = None


def forget_gone_writers(now: datetime) -> None:
    """Delete the rows of gateways gone for SIGNAL_KEEP: at most once a minute a process."""
    global _forgot_at
    if _forgot_at is not None and now - _forgot_at < timedelta(minutes=1):
        return
    _forgot_at = now
    LoadSignal.objects.filter(at__lt=now - SIGNAL_KEEP).delete()


def _when(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _figure(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def evaluate(now: datetime, models: Iterable[Model], default_idle: int) -> None:
    """Decide every policy's replica count for now (see the module), writing the models whose
    state changed; their `autoscale_state` in memory is the one written."""
    forget_gone_writers(now)
    with_policy = [m for m in models if m.autoscale]
    if not with_policy:
        return
    loads = read_loads(now)
    counts: dict[int, list[int]] = {}  # model id -> [replicas, ready, most slots]
    for model_id, state, slots in Replica.objects.filter(
        model_id__in=[m.pk for m in with_policy], withdrawn_at__isnull=True
    ).values_list("model_id", "state", "slots"):
        entry = counts.setdefault(model_id, [0, 0, 0])
        entry[0] += 1
        entry[1] += state == Replica.READY
        entry[2] = max(entry[2], slots or 0)
    audit: list[AuditEntry] = []
    changed = []
    for model in with_policy:
        decided = decide(model, now, default_idle, loads, counts.get(model.pk, [0, 0, 0]), audit)
        if decided != model.autoscale_state:
            model.autoscale_state = decided
            changed.append(model)
    if changed:  # one query, however many policies (their figures change at every pass)
        Model.objects.bulk_update(changed, ["autoscale_state"], batch_size=500)
    if audit:
        AuditEntry.objects.bulk_create(audit)


def decide(
    model: Model,
    now: datetime,
    default_idle: int,
    loads: dict[str, Load] | None,
    replicas: list[int],
    audit: list[AuditEntry],
) -> dict[str, Any]:
    """The model's new autoscale state (a fresh dict), an audit entry added for a step."""
    policy = model.autoscale or {}
    wait, up_after, down_after = policy["wait"], policy["up_after"], policy["down_after"]
    old = model.autoscale_state or {}
    floor = model.floor_replicas(now, default_idle)
    ceiling = model.effective_max
    if floor == 0:
        why = "on demand and not asked for: nothing runs" if model.on_demand else "min 0"
        return {"replicas": 0, "why": why}
    count = old.get("replicas")
    current = floor if not isinstance(count, int) or count < floor else min(count, ceiling)
    placed, ready, slots = replicas
    slots = slots or (model.profiles[0].get("slots") if model.profiles else None) or DEFAULT_SLOTS
    changed_at = _when(old.get("changed_at"))
    above_since = _when(old.get("above_since"))
    spare_since = _when(old.get("spare_since"))
    state: dict[str, Any] = {"replicas": current}
    if changed_at is not None:
        state["changed_at"] = changed_at.isoformat()
    of = f"{current} of max {ceiling}"

    if loads is None:
        state["why"] = f"{of}: no gateway has reported its queue, so nothing is decided"
        return state
    load = loads.get(model.name) or Load()
    p50 = wait_quantile(load.waits, 0.5)
    state["figures"] = {
        "wait_p50_seconds": None if p50 is None else round(p50, 2),
        "waiting": load.waiting,
        "in_service": load.in_service,
        "slots": slots * current,
        "at": now.isoformat(),
    }
    above = p50 is not None and p50 > wait
    spare = (
        not above
        and load.waiting == 0
        and (p50 is None or p50 == 0.0)
        and load.in_service <= (current - 1) * slots
    )
    since_change = math.inf if changed_at is None else (now - changed_at).total_seconds()
    target = f"{format_duration(wait)}"

    if above:
        above_since = above_since or now
        held = (now - above_since).total_seconds()
        said = f"queue wait p50 {_figure(p50)} over {target} for {format_duration(int(held))}"
        if current >= ceiling:
            state["why"] = f"{of}: {said}, at its max"
        elif ready < current or placed < current:
            above_since = None  # counted again once the replicas it has are serving
            state["why"] = f"{of}: {said}; waiting for its replicas to be ready before adding one"
        elif held >= up_after and since_change >= up_after:
            return _step(model, state, now, current + 1, ceiling, f"{said}", "up", audit)
        else:
            state["why"] = f"{of}: {said} of the {format_duration(up_after)} it takes to add one"
        if above_since is not None:
            state["above_since"] = above_since.isoformat()
        return state
    if spare and current > floor:
        spare_since = spare_since or now
        held = (now - spare_since).total_seconds()
        said = (
            f"{load.in_service} of {slots * current} slots in use, nobody waiting, for "
            f"{format_duration(int(held))}"
        )
        if held >= down_after and since_change >= down_after:
            return _step(model, state, now, current - 1, ceiling, said, "down", audit)
        state["why"] = f"{of}: {said} of the {format_duration(down_after)} it takes to remove one"
        state["spare_since"] = spare_since.isoformat()
        return state
    if p50 is None:
        state["why"] = f"{of}: no requests lately"
    else:
        state["why"] = f"{of}: queue wait p50 {_figure(p50)}, within {target}"
    return state


def _step(
    model: Model,
    state: dict[str, Any],
    now: datetime,
    replicas: int,
    ceiling: int,
    said: str,
    direction: str,
    audit: list[AuditEntry],
) -> dict[str, Any]:
    state.update(replicas=replicas, changed_at=now.isoformat())
    state["why"] = f"{replicas} of max {ceiling}: {said}"
    audit.append(
        audit_entry(
            SYSTEM,
            model.name,
            "autoscale",
            f"{direction} to {replicas}: {said}",
            before={"replicas": replicas - 1 if direction == "up" else replicas + 1},
            after={"replicas": replicas, "figures": state.get("figures")},
        )
    )
    control_metrics().autoscale_steps.labels(model.name, direction).inc()
    return state

"""Canary updates: the new weights on one replica, a share of the requests sent to it, and the
control plane deciding from the gateway's figures whether the update goes on or goes back.

    start_canary_update   the update starts as any other (fetch, check, swap); the model's
                          `canary` says which share of its requests the new revision gets
    advance_canary        waiting -> watching once the canary replica is ready (the window
                          starts then); a canary replica that keeps failing to start, or a
                          rollout that ended another way, ends the canary
    check_canary          compares the two revisions' figures (judge); unhealthy at any check
                          rolls back, healthy at the end of the window promotes
    promote_canary /      by hand at any time (the model's owner or staff)
    abort_canary

While the canary runs, the reconciler keeps one replica of the new revision beside all the old
ones (fleet.reconciler._replacement) and the gateway splits the requests (gateway.canary).
Promoted, the replacement goes on one replica at a time as any update's; rolled back, the model
points at its old files again, so the canary replica is the out-of-date one and leaves, while
the old replicas, which never stopped, keep serving.

The check runs every LLMGW_CANARY_CHECK_SECONDS (gateway.tasks.check_canaries, which reads the
figures the gateway writes every few seconds). Every change of state writes an audit entry in
the same transaction; a rollback's entry holds both revisions' figures.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from catalog.durations import DurationError, format_duration, parse_duration
from catalog.errors import CatalogError, Problem, conflict
from catalog.models import CANARY_ACTIVE, Model
from catalog.services import (
    SYSTEM,
    Actor,
    announce,
    get_model,
    lock_catalog,
    record_change,
    record_event,
    require_change_rights,
)
from fleet.models import Replica
from fleet.specs import replica_revision, weights_revision

from .models import Rollout
from .rollouts import start_update

# -- settings of one canary ---------------------------------------------------------------

DEFAULT_WINDOW = "10m"
DEFAULT_MAX_ERROR_RATE = 0.05
DEFAULT_MAX_LATENCY_RATIO = 2.0
MIN_WINDOW_SECONDS = 10
# The gateway keeps its figures per revision by the minute for a day (then folds them into
# hours without revisions), so a window is at most that.
MAX_WINDOW_SECONDS = 86400
MAX_LATENCY_RATIO_LIMIT = 100.0
# Answers faster than this count as this fast when latencies are compared: a ratio over a
# near-zero figure (an engine answering from memory) says nothing.
LATENCY_FLOOR_SECONDS = 0.01


@dataclass(frozen=True)
class CanarySettings:
    percent: int
    window_seconds: int
    max_error_rate: float
    max_latency_ratio: float


def canary_settings(
    *,
    percent: Any,
    window: Any = None,
    max_error_rate: Any = None,
    max_latency_ratio: Any = None,
) -> CanarySettings:
    """The settings of a canary, each checked, or a 400 naming what is wrong and how to say it."""
    if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 99:
        raise _bad(
            f"--canary must be a whole percentage from 1 to 99 (got {_shown(percent)}): the share "
            "of the model's requests the new revision gets while the rest go to the old one.",
            "canary",
        )
    try:
        seconds = parse_duration(DEFAULT_WINDOW if window is None else window)
    except DurationError as exc:
        raise _bad(f"--for: {exc}.", "for") from None
    if not MIN_WINDOW_SECONDS <= seconds <= MAX_WINDOW_SECONDS:
        raise _bad(
            f"--for must be between {format_duration(MIN_WINDOW_SECONDS)} and "
            f"{format_duration(MAX_WINDOW_SECONDS)} (got {_shown(window)}): how long the canary "
            "serves before it is promoted when healthy.",
            "for",
        )
    error_rate = DEFAULT_MAX_ERROR_RATE if max_error_rate is None else max_error_rate
    if not _number(error_rate) or not 0 <= error_rate < 1:
        raise _bad(
            f"--max-error-rate must be a fraction from 0 up to (not including) 1, like 0.05 for 5% "
            f"(got {_shown(max_error_rate)}): the share of the new revision's answers that may be "
            "server errors.",
            "max_error_rate",
        )
    ratio = DEFAULT_MAX_LATENCY_RATIO if max_latency_ratio is None else max_latency_ratio
    if not _number(ratio) or not 1 <= ratio <= MAX_LATENCY_RATIO_LIMIT:
        raise _bad(
            f"--max-latency-ratio must be a number from 1 to {MAX_LATENCY_RATIO_LIMIT:g} (got "
            f"{_shown(max_latency_ratio)}): how many times slower than the old revision the new "
            "one may answer on average.",
            "max_latency_ratio",
        )
    return CanarySettings(
        percent=percent,
        window_seconds=seconds,
        max_error_rate=float(error_rate),
        max_latency_ratio=float(ratio),
    )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(message: str, field: str) -> CatalogError:
    return CatalogError(message, code="invalid_canary", problems=[Problem(field, message)])


# -- the decision rule --------------------------------------------------------------------


@dataclass(frozen=True)
class RevisionFigures:
    """What the gateway answered for one revision since the window started."""

    requests: int = 0
    errors: int = 0  # server errors (5xx): a client's bad request says nothing of the weights
    seconds: float = 0.0  # answering time, summed

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def mean_latency(self) -> float | None:
        return self.seconds / self.requests if self.requests else None


@dataclass(frozen=True)
class KeyFigures:
    """What the gateway answered one key on each revision since the window started."""

    old: RevisionFigures
    new: RevisionFigures


# A key's own figures on the old revision are its baseline once the old revision has answered
# this many of its requests; below that, the old revision's rate over every key stands in.
KEY_BASELINE_REQUESTS = 5
# A key's errors on the new revision count only beyond its baseline plus this many standard
# deviations of chance: checks run every 15 s for the whole window, and a key whose requests
# fail half the time on both revisions must not roll a canary back by luck of the split.
CHANCE_MARGIN = 3.0


@dataclass(frozen=True)
class Excess:
    """The new revision's server errors that the keys' own baselines do not explain."""

    errors: float
    keys_sending: int  # keys the new revision answered
    keys_with_excess: int
    # Of those, keys with a baseline of their own: one of them alone is evidence.
    baselined_with_excess: int
    # The old revision's mean latency for the new revision's mix of keys.
    expected_latency: float | None

    @property
    def decisive(self) -> bool:
        """Whether the excess may decide: it comes from a key whose own old-revision figures
        show the difference, or from two keys or more, or from the only key sending."""
        return (
            self.baselined_with_excess >= 1
            or self.keys_with_excess >= 2
            or (self.keys_sending == 1 and self.keys_with_excess == 1)
        )

    def summary(self) -> dict[str, Any]:
        return {
            "sending": self.keys_sending,
            "with_excess": self.keys_with_excess,
            "excess_errors": round(self.errors, 2),
        }


def excess(keys: dict[int, KeyFigures], old_total: RevisionFigures) -> Excess:
    """Each key's server errors on the new revision beyond what the same key saw on the old one
    (with CHANCE_MARGIN for chance), summed; see judge."""
    pooled = old_total.error_rate if old_total.requests >= KEY_BASELINE_REQUESTS else 0.0
    pooled_latency = old_total.mean_latency
    total = 0.0
    sending = with_excess = baselined_with_excess = 0
    weighted_latency = 0.0
    weighted_requests = 0
    for seen in keys.values():
        new, old = seen.new, seen.old
        if new.requests == 0:
            continue
        sending += 1
        baselined = old.requests >= KEY_BASELINE_REQUESTS
        if baselined:
            rate, compared_with = old.error_rate, old.requests
        else:
            rate, compared_with = pooled, old_total.requests
        expected = new.requests * rate
        # The spread of (errors - expected) when both sides fail at `rate`: binomial on the new
        # side plus the old side's estimate of the rate, scaled to the new side's requests.
        spread = math.sqrt(
            new.requests * rate * (1 - rate) * (1 + new.requests / max(compared_with, 1))
        )
        beyond = new.errors - expected - CHANCE_MARGIN * spread
        if beyond > 0:
            total += beyond
            with_excess += 1
            baselined_with_excess += baselined
        latency = old.mean_latency if baselined else pooled_latency
        if latency is not None:
            weighted_latency += latency * new.requests
            weighted_requests += new.requests
    return Excess(
        errors=total,
        keys_sending=sending,
        keys_with_excess=with_excess,
        baselined_with_excess=baselined_with_excess,
        expected_latency=weighted_latency / weighted_requests if weighted_requests else None,
    )


@dataclass(frozen=True)
class Verdict:
    outcome: str  # healthy | unhealthy | undecided
    reason: str
    excess: Excess | None = None


def judge(
    old: RevisionFigures,
    new: RevisionFigures,
    settings_: CanarySettings,
    *,
    min_requests: int,
    window_over: bool,
    keys: dict[int, KeyFigures] | None = None,
) -> Verdict:
    """Is the new revision healthy, judged against the old one?

    1. Until the new revision has answered `min_requests` requests nothing is decided: a few
       requests are noise (one error in three is not a 33% error rate). A window that ends
       before then waits for them.
    2. Server errors, judged per gateway key (`keys`, the figures of each key on each
       revision) so that no key can swing the decision beyond its share of the traffic:
       - The split is random per request, so an error caused by the request itself (a body the
         engine cannot take) falls on both revisions alike. A key's errors on the new revision
         therefore count only beyond what the same key saw on the old one: its old-revision
         error rate times its new-revision requests, plus CHANCE_MARGIN standard deviations of
         chance. A key that fails alike on both revisions is no evidence against the canary.
       - A key whose requests the old revision answered fewer than KEY_BASELINE_REQUESTS times
         is compared with the old revision's rate over all keys instead (none when the old
         revision answered nothing, as when the canary took the place of a model's only
         replica). Such a key's excess alone decides nothing while other keys are sending:
         it must come with another key's excess, or be the only key sending.
       - A key's excess is at most its own requests to the new revision, so no key counts for
         more than its share of the traffic.
       The summed excess, as a share of the new revision's answers, above `max_error_rate` is
       unhealthy.
       Without per-key figures (an older gateway), the new revision's server-error rate above
       the limit, and above the old revision's, is unhealthy (when the old revision fails as
       often, the cause is elsewhere: the engine host, the load).
    3. Its mean latency more than `max_latency_ratio` times the old revision's is unhealthy,
       once both have answered `min_requests` requests. With per-key figures the old
       revision's latency is taken for the new revision's mix of keys (each key's own old mean,
       weighted by its new requests), so one key's slow requests weigh alike on both sides.
       Latencies below LATENCY_FLOOR_SECONDS count as that, so a ratio over a near-zero figure
       decides nothing.
    4. Otherwise: healthy when the window is over, undecided before.
    """
    if new.requests < min_requests:
        waiting = (
            "the window is over, so the canary waits for them (promote or abort it by hand)"
            if window_over
            else "nothing is decided before"
        )
        return Verdict(
            "undecided",
            f"the new revision has answered {new.requests} of the {min_requests} requests a "
            f"decision needs; {waiting}",
        )
    beyond = excess(keys, old) if keys else None
    if beyond is not None:
        rate = beyond.errors / new.requests
        if rate > settings_.max_error_rate and beyond.decisive:
            return Verdict(
                "unhealthy",
                f"server errors on the new revision beyond what each key saw on the old one: "
                f"{beyond.errors:.0f} of {new.requests} ({rate:.1%}), from "
                f"{beyond.keys_with_excess} of {beyond.keys_sending} keys, above the limit of "
                f"{settings_.max_error_rate:.1%} (all server errors: new {new.errors} of "
                f"{new.requests}, old {old.errors} of {old.requests})",
                beyond,
            )
    elif new.error_rate > settings_.max_error_rate and new.error_rate > old.error_rate:
        return Verdict(
            "unhealthy",
            f"server errors on the new revision: {new.errors} of {new.requests} "
            f"({new.error_rate:.1%}), above the limit of {settings_.max_error_rate:.1%} "
            f"(old revision: {old.errors} of {old.requests}, {old.error_rate:.1%})",
        )
    latency_note = ""
    if old.requests >= min_requests:
        expected = beyond.expected_latency if beyond is not None else None
        new_latency = max(new.mean_latency or 0.0, LATENCY_FLOOR_SECONDS)
        old_latency = max(
            expected if expected is not None else (old.mean_latency or 0.0),
            LATENCY_FLOOR_SECONDS,
        )
        ratio = new_latency / old_latency
        if ratio > settings_.max_latency_ratio:
            return Verdict(
                "unhealthy",
                f"the new revision answers {ratio:.1f} times slower than the old one on average "
                f"({new_latency:.3f} s against {old_latency:.3f} s), above the limit of "
                f"{settings_.max_latency_ratio:g}",
                beyond,
            )
        latency_note = f", {ratio:.2f} times the old revision's latency"
    else:
        latency_note = (
            f"; latency not compared: the old revision answered {old.requests} of the "
            f"{min_requests} requests that needs"
        )
    summary = (
        f"{new.errors} server errors in {new.requests} answers ({new.error_rate:.1%}){latency_note}"
    )
    if beyond is not None and new.errors:
        summary += (
            f"; {beyond.errors:.0f} of them beyond what each key saw on the old revision "
            f"({beyond.keys_with_excess} of {beyond.keys_sending} keys)"
        )
    if window_over:
        return Verdict("healthy", f"healthy through the window: {summary}", beyond)
    return Verdict("undecided", f"healthy so far: {summary}", beyond)


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
            "revision": weights_revision(rollout.to_source, weights.get("sha256")),
            "from_revision": weights_revision(model.source, model.sha256 or None),
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


# -- progress and checks -------------------------------------------------------------------


def active_canaries() -> list[Model]:
    return [m for m in Model.objects.exclude(canary=None) if m.canary_in_force is not None]


def advance_canary(
    model: Model,
    *,
    baseline: dict[str, RevisionFigures] | None = None,
    now: datetime | None = None,
) -> bool:
    """Start the window once the canary replica is ready; end a canary whose rollout ended or
    whose replica cannot start. True when the window started now.

    `baseline` is what the gateway's figures (from the minute of `now` on) held at the start:
    the checks count what came after it, so requests before the window (and a canary of the
    same revision tried a moment before) decide nothing."""
    now = now or timezone.now()
    canary = model.canary or {}
    rollout = _rollout_of(canary)
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
    minute the window started in; its baseline is taken off); rolls it back or promotes it when
    that is decided. None when the canary is not watching.

    `keys` holds each gateway key's figures per revision (registry.models.CanaryKeyMinute),
    from the minute the window started in: judge weighs errors per key with them. They carry no
    baseline of their own (that would be a row per key in the canary's record), so up to a
    minute of answers from before the window may count in them; they only ever compare a key's
    two revisions with each other, which such answers leave fair."""
    now = now or timezone.now()
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
    if verdict.outcome == "unhealthy":
        _roll_back(model.name, SYSTEM, f"unhealthy: {verdict.reason}", figures=seen)
    elif verdict.outcome == "healthy":
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


def stored_settings(canary: dict[str, Any]) -> CanarySettings:
    return CanarySettings(
        percent=canary["percent"],
        window_seconds=canary["window_seconds"],
        max_error_rate=canary["max_error_rate"],
        max_latency_ratio=canary["max_latency_ratio"],
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
        rollout = _rollout_of(canary)
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


def _rollout_of(canary: dict[str, Any]) -> Rollout | None:
    rollout_id = canary.get("rollout")
    if not isinstance(rollout_id, int):
        return None
    return Rollout.objects.filter(pk=rollout_id).first()


def _show_step(canary: dict[str, Any], step: str) -> None:
    rollout = _rollout_of(canary)
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


# -- reads --------------------------------------------------------------------------------


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

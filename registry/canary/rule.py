"""A canary's settings and the rule that decides it: pure values and functions, no database.

CanarySettings    what was asked (canary_settings checks it; stored_settings reads it back)
RevisionFigures   what one revision answered since the window started
judge             the figures of both revisions (and of each key) -> a Verdict, whose
                  Outcome (healthy, unhealthy, undecided) the check acts on
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from core.durations import DurationError, format_duration, parse_duration
from core.refusals import Problem, Refused

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


def stored_settings(canary: dict[str, Any]) -> CanarySettings:
    return CanarySettings(
        percent=canary["percent"],
        window_seconds=canary["window_seconds"],
        max_error_rate=canary["max_error_rate"],
        max_latency_ratio=canary["max_latency_ratio"],
    )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(message: str, field: str) -> Refused:
    return Refused(message, code="invalid_canary", problems=[Problem(field, message)])


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


class Outcome(StrEnum):
    """What a check decides: the canary is promoted, rolled back, or watched on."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    UNDECIDED = "undecided"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
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
    """Is the new revision healthy, judged against the old one? The rules, in order:

    1. Enough answers to decide (_waiting_for_answers).
    2. Server errors within the limit (_too_many_errors).
    3. Latency within the limit (_latency_ratio, _too_slow).
    4. Otherwise: healthy when the window is over, undecided before.
    """
    waiting = _waiting_for_answers(new, min_requests=min_requests, window_over=window_over)
    if waiting is not None:
        return waiting
    beyond = excess(keys, old) if keys else None
    errors = _too_many_errors(old, new, settings_, beyond)
    if errors is not None:
        return errors
    if old.requests < min_requests:
        latency_note = (
            f"; latency not compared: the old revision answered {old.requests} of the "
            f"{min_requests} requests that needs"
        )
    else:
        ratio, new_latency, old_latency = _latency_ratio(old, new, beyond)
        if ratio > settings_.max_latency_ratio:
            return _too_slow(ratio, new_latency, old_latency, settings_, beyond)
        latency_note = f", {ratio:.2f} times the old revision's latency"
    return _healthy(new, beyond, latency_note, window_over=window_over)


def _waiting_for_answers(
    new: RevisionFigures, *, min_requests: int, window_over: bool
) -> Verdict | None:
    """Until the new revision has answered `min_requests` requests nothing is decided: a few
    requests are noise (one error in three is not a 33% error rate). A window that ends before
    then waits for them."""
    if new.requests >= min_requests:
        return None
    waiting = (
        "the window is over, so the canary waits for them (promote or abort it by hand)"
        if window_over
        else "nothing is decided before"
    )
    return Verdict(
        Outcome.UNDECIDED,
        f"the new revision has answered {new.requests} of the {min_requests} requests a "
        f"decision needs; {waiting}",
    )


def _too_many_errors(
    old: RevisionFigures,
    new: RevisionFigures,
    settings_: CanarySettings,
    beyond: Excess | None,
) -> Verdict | None:
    """Server errors, judged per gateway key (`beyond`, from the figures of each key on each
    revision) so that no key can swing the decision beyond its share of the traffic:

    - The split is random per request, so an error caused by the request itself (a body the
      engine cannot take) falls on both revisions alike. A key's errors on the new revision
      therefore count only beyond what the same key saw on the old one: its old-revision error
      rate times its new-revision requests, plus CHANCE_MARGIN standard deviations of chance. A
      key that fails alike on both revisions is no evidence against the canary.
    - A key whose requests the old revision answered fewer than KEY_BASELINE_REQUESTS times is
      compared with the old revision's rate over all keys instead (none when the old revision
      answered nothing, as when the canary took the place of a model's only replica). Such a
      key's excess alone decides nothing while other keys are sending: it must come with
      another key's excess, or be the only key sending.
    - A key's excess is at most its own requests to the new revision, so no key counts for more
      than its share of the traffic.

    The summed excess, as a share of the new revision's answers, above `max_error_rate` is
    unhealthy. Without per-key figures (an older gateway), the new revision's server-error rate
    above the limit, and above the old revision's, is unhealthy (when the old revision fails as
    often, the cause is elsewhere: the engine host, the load)."""
    if beyond is not None:
        rate = beyond.errors / new.requests
        if rate > settings_.max_error_rate and beyond.decisive:
            return Verdict(
                Outcome.UNHEALTHY,
                f"server errors on the new revision beyond what each key saw on the old one: "
                f"{beyond.errors:.0f} of {new.requests} ({rate:.1%}), from "
                f"{beyond.keys_with_excess} of {beyond.keys_sending} keys, above the limit of "
                f"{settings_.max_error_rate:.1%} (all server errors: new {new.errors} of "
                f"{new.requests}, old {old.errors} of {old.requests})",
                beyond,
            )
    elif new.error_rate > settings_.max_error_rate and new.error_rate > old.error_rate:
        return Verdict(
            Outcome.UNHEALTHY,
            f"server errors on the new revision: {new.errors} of {new.requests} "
            f"({new.error_rate:.1%}), above the limit of {settings_.max_error_rate:.1%} "
            f"(old revision: {old.errors} of {old.requests}, {old.error_rate:.1%})",
        )
    return None


def _latency_ratio(
    old: RevisionFigures, new: RevisionFigures, beyond: Excess | None
) -> tuple[float, float, float]:
    """How many times slower the new revision answers than the old one, and the two mean
    latencies compared; taken once both have answered `min_requests` requests.

    With per-key figures the old revision's latency is taken for the new revision's mix of keys
    (each key's own old mean, weighted by its new requests), so one key's slow requests weigh
    alike on both sides. Latencies below LATENCY_FLOOR_SECONDS count as that, so a ratio over
    a near-zero figure decides nothing."""
    expected = beyond.expected_latency if beyond is not None else None
    new_latency = max(new.mean_latency or 0.0, LATENCY_FLOOR_SECONDS)
    old_latency = max(
        expected if expected is not None else (old.mean_latency or 0.0),
        LATENCY_FLOOR_SECONDS,
    )
    return new_latency / old_latency, new_latency, old_latency


def _too_slow(
    ratio: float,
    new_latency: float,
    old_latency: float,
    settings_: CanarySettings,
    beyond: Excess | None,
) -> Verdict:
    """A mean latency more than `max_latency_ratio` times the old revision's is unhealthy."""
    return Verdict(
        Outcome.UNHEALTHY,
        f"the new revision answers {ratio:.1f} times slower than the old one on average "
        f"({new_latency:.3f} s against {old_latency:.3f} s), above the limit of "
        f"{settings_.max_latency_ratio:g}",
        beyond,
    )


def _healthy(
    new: RevisionFigures, beyond: Excess | None, latency_note: str, *, window_over: bool
) -> Verdict:
    """Nothing against the new revision: healthy once the window is over, undecided before."""
    summary = (
        f"{new.errors} server errors in {new.requests} answers ({new.error_rate:.1%}){latency_note}"
    )
    if beyond is not None and new.errors:
        summary += (
            f"; {beyond.errors:.0f} of them beyond what each key saw on the old revision "
            f"({beyond.keys_with_excess} of {beyond.keys_sending} keys)"
        )
    if window_over:
        return Verdict(Outcome.HEALTHY, f"healthy through the window: {summary}", beyond)
    return Verdict(Outcome.UNDECIDED, f"healthy so far: {summary}", beyond)

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

The check runs every LLMGW_CANARY_CHECK_SECONDS (check.check_canaries, queued by beat as
gateway.tasks.check_canaries, which passes in the figures the gateway writes every few seconds).
Every change of state writes an audit entry in the same transaction; a rollback's entry holds
both revisions' figures.

The package, one job a module (each importing only those before it):

    rule        the settings of a canary and the rule that judges it (pure)
    selectors   reads: canaries under way, a canary as shown, the per-key figures
    services    the lifecycle: start, advance, check, promote, abort (writes, audited)
    check       the periodic check over every canary under way
"""

from .check import RevisionFiguresReader, check_canaries
from .rule import (
    CHANCE_MARGIN,
    DEFAULT_MAX_ERROR_RATE,
    DEFAULT_MAX_LATENCY_RATIO,
    DEFAULT_WINDOW,
    KEY_BASELINE_REQUESTS,
    LATENCY_FLOOR_SECONDS,
    MAX_LATENCY_RATIO_LIMIT,
    MAX_WINDOW_SECONDS,
    MIN_WINDOW_SECONDS,
    CanarySettings,
    Excess,
    KeyFigures,
    Outcome,
    RevisionFigures,
    Verdict,
    canary_settings,
    excess,
    judge,
    stored_settings,
)
from .selectors import (
    active_canaries,
    canaries,
    canary_view,
    describe_figures,
    key_figures,
    names_counted,
    rollout_of,
)
from .services import (
    abort_canary,
    advance_canary,
    check_canary,
    promote_canary,
    start_canary_update,
)

__all__ = [
    "CHANCE_MARGIN",
    "DEFAULT_MAX_ERROR_RATE",
    "DEFAULT_MAX_LATENCY_RATIO",
    "DEFAULT_WINDOW",
    "KEY_BASELINE_REQUESTS",
    "LATENCY_FLOOR_SECONDS",
    "MAX_LATENCY_RATIO_LIMIT",
    "MAX_WINDOW_SECONDS",
    "MIN_WINDOW_SECONDS",
    "CanarySettings",
    "Excess",
    "KeyFigures",
    "Outcome",
    "RevisionFigures",
    "RevisionFiguresReader",
    "Verdict",
    "abort_canary",
    "active_canaries",
    "advance_canary",
    "canaries",
    "canary_settings",
    "canary_view",
    "check_canaries",
    "check_canary",
    "describe_figures",
    "excess",
    "judge",
    "key_figures",
    "names_counted",
    "promote_canary",
    "rollout_of",
    "start_canary_update",
    "stored_settings",
]

"""Canary updates: the new weights on one replica, a share of the requests sent to it, and the
control plane deciding from the gateway's figures whether the update goes on or goes back.

rule (the settings and the rule, pure), selectors (reads), services (start, advance, check,
promote, abort: writes, audited), check (the periodic check over every canary under way).
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

"""A gateway process's limit counters where the web reads them (VAR_DIR/gateway-limits), and
requests let through them as the gateway lets them through, so that use now has figures."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from access.models import GatewayKey, Team
from access.services import COUNTERS
from gateway.limits import Admission, Limits, SharedCounters, limits_of, no_budgets


@contextmanager
def gateway_files(folder: Path, settings: Any) -> Iterator[SharedCounters]:
    """Counters of this process in `folder`/gateway-limits, with VAR_DIR pointed at `folder`
    (pytest-django's `settings`, so the change is undone after the test)."""
    settings.VAR_DIR = folder
    # Where REDIS_URL is set (CI may set it), live_use reads Redis's counts instead of the files.
    settings.LLMGW_LIMITS_REDIS = "off"
    counters = SharedCounters(folder / "gateway-limits", writer="test")
    try:
        yield counters
    finally:
        counters.close()


def _limits(holder: GatewayKey | Team) -> Limits:
    return limits_of(
        **{name: getattr(holder, name) for name in COUNTERS},
        models=holder.models,
        weight=holder.weight,
        team_id=getattr(holder, "team_id", None),
    )


def admit(counters: SharedCounters, key: GatewayKey) -> Admission:
    """Let one request of `key` (and its team) through, as the gateway does: it stays in flight
    until released."""
    key.refresh_from_db()
    team = _limits(key.team) if key.team is not None else None
    admission = counters.admit(key.pk, _limits(key), team, no_budgets())
    assert isinstance(admission, Admission), admission  # let through, not refused
    return admission

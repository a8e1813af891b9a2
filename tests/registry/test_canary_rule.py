"""The canary's decision rule and the checks of its settings: pure functions, no database."""

from __future__ import annotations

from typing import Any

import pytest

from core.refusals import Refused
from registry.canary import (
    CanarySettings,
    Outcome,
    RevisionFigures,
    canary_settings,
    describe_figures,
    judge,
)

LIMITS = CanarySettings(percent=10, window_seconds=600, max_error_rate=0.05, max_latency_ratio=2.0)
OLD = RevisionFigures(requests=100, errors=0, seconds=20.0)  # 0.2 s on average


def verdict(
    old: RevisionFigures, new: RevisionFigures, *, over: bool = False, minimum: int = 20
) -> Outcome:
    return judge(old, new, LIMITS, min_requests=minimum, window_over=over).outcome


# -- the rule -------------------------------------------------------------------------------


def test_it_decides_nothing_below_the_minimum_of_requests_even_when_all_fail() -> None:
    assert verdict(OLD, RevisionFigures(requests=19, errors=19, seconds=1)) == "undecided"
    assert verdict(OLD, RevisionFigures(requests=20, errors=19, seconds=1)) == "unhealthy"


def test_it_decides_with_an_outcome_the_check_can_compare_by_identity() -> None:
    assert verdict(OLD, RevisionFigures(requests=19, errors=19, seconds=1)) is Outcome.UNDECIDED
    assert verdict(OLD, RevisionFigures(requests=20, errors=19, seconds=1)) is Outcome.UNHEALTHY
    assert verdict(OLD, RevisionFigures(requests=50, seconds=10), over=True) is Outcome.HEALTHY


def test_a_window_that_ends_with_too_few_requests_waits_for_them() -> None:
    found = judge(
        OLD, RevisionFigures(requests=3, seconds=0.6), LIMITS, min_requests=20, window_over=True
    )
    assert found.outcome == "undecided"
    assert "answered 3 of the 20 requests" in found.reason and "waits for them" in found.reason


def test_errors_above_the_limit_are_unhealthy() -> None:
    found = judge(
        OLD,
        RevisionFigures(requests=100, errors=6, seconds=20),
        LIMITS,
        min_requests=20,
        window_over=False,
    )
    assert found.outcome == "unhealthy"
    assert found.reason == (
        "server errors on the new revision: 6 of 100 (6.0%), above the limit of 5.0% "
        "(old revision: 0 of 100, 0.0%)"
    )


def test_errors_at_the_limit_are_not() -> None:
    assert verdict(OLD, RevisionFigures(requests=100, errors=5, seconds=20), over=True) == "healthy"


def test_errors_the_old_revision_has_as_often_are_not_the_new_ones_fault() -> None:
    failing_old = RevisionFigures(requests=100, errors=30, seconds=20)
    assert (
        verdict(failing_old, RevisionFigures(requests=100, errors=30, seconds=20), over=True)
        == "healthy"
    )
    assert verdict(failing_old, RevisionFigures(requests=100, errors=31, seconds=20)) == "unhealthy"


def test_a_zero_error_limit_rolls_back_on_any_error() -> None:
    strict = CanarySettings(
        percent=10, window_seconds=600, max_error_rate=0.0, max_latency_ratio=2.0
    )
    new = RevisionFigures(requests=50, errors=1, seconds=10)
    assert judge(OLD, new, strict, min_requests=20, window_over=False).outcome == "unhealthy"


def test_latency_more_than_the_ratio_slower_is_unhealthy() -> None:
    found = judge(
        OLD,
        RevisionFigures(requests=50, seconds=50 * 0.41),
        LIMITS,
        min_requests=20,
        window_over=False,
    )
    assert found.outcome == "unhealthy"
    assert "2.0 times slower" in found.reason and "0.410 s against 0.200 s" in found.reason
    assert verdict(OLD, RevisionFigures(requests=50, seconds=50 * 0.39), over=True) == "healthy"


def test_latency_is_not_compared_while_the_old_revision_has_too_few_requests() -> None:
    few_old = RevisionFigures(requests=5, seconds=0.5)
    found = judge(
        few_old,
        RevisionFigures(requests=50, seconds=500),
        LIMITS,
        min_requests=20,
        window_over=True,
    )
    assert found.outcome == "healthy"
    assert "latency not compared: the old revision answered 5 of the 20" in found.reason


def test_zero_latencies_do_not_make_an_infinite_ratio() -> None:
    instant = RevisionFigures(requests=100, seconds=0.0)
    assert verdict(instant, RevisionFigures(requests=100, seconds=0.0), over=True) == "healthy"
    # Both below the floor: 5 ms against 0 ms is no slowdown worth a rollback.
    assert verdict(instant, RevisionFigures(requests=100, seconds=0.5), over=True) == "healthy"
    # Above the floor it counts against the floor: 30 ms is 3 times 10 ms.
    assert verdict(instant, RevisionFigures(requests=100, seconds=3.0)) == "unhealthy"


def test_an_old_revision_with_no_requests_at_all_is_no_error_baseline() -> None:
    nothing = RevisionFigures()
    assert (
        verdict(nothing, RevisionFigures(requests=40, errors=1, seconds=8), over=True) == "healthy"
    )
    assert verdict(nothing, RevisionFigures(requests=40, errors=3, seconds=8)) == "unhealthy"


def test_healthy_before_the_end_of_the_window_is_undecided() -> None:
    found = judge(
        OLD, RevisionFigures(requests=40, seconds=8), LIMITS, min_requests=20, window_over=False
    )
    assert found.outcome == "undecided" and found.reason.startswith(
        "healthy so far: 0 server errors"
    )


def test_the_figures_read_as_one_sentence() -> None:
    figures = {
        "old": {"requests": 4, "errors": 0, "seconds": 0.8},
        "new": {"requests": 2, "errors": 2, "seconds": 0.02},
    }
    assert describe_figures(figures) == (
        "old revision: 4 requests, 0 server errors, mean latency 0.200 s; "
        "new revision: 2 requests, 2 server errors, mean latency 0.010 s."
    )
    assert describe_figures(None) == "No figures were checked yet."


# -- the settings ---------------------------------------------------------------------------


def test_the_defaults() -> None:
    assert canary_settings(percent=10) == CanarySettings(
        percent=10, window_seconds=600, max_error_rate=0.05, max_latency_ratio=2.0
    )
    assert canary_settings(
        percent=1, window="1h30m", max_error_rate=0, max_latency_ratio=1
    ) == CanarySettings(percent=1, window_seconds=5400, max_error_rate=0.0, max_latency_ratio=1.0)


@pytest.mark.parametrize(
    ("given", "field", "says"),
    [
        ({"percent": 0}, "canary", "--canary must be a whole percentage from 1 to 99 (got 0)"),
        ({"percent": 100}, "canary", "(got 100)"),
        ({"percent": -5}, "canary", "(got -5)"),
        ({"percent": 12.5}, "canary", "(got 12.5)"),
        ({"percent": True}, "canary", "(got True)"),
        ({"percent": "10"}, "canary", "(got '10')"),
        ({"percent": None}, "canary", "(got None)"),
        ({"percent": 10, "window": "5s"}, "for", "--for must be between 10s and 1d (got '5s')"),
        ({"percent": 10, "window": "25h"}, "for", "(got '25h')"),
        ({"percent": 10, "window": "0"}, "for", "(got '0')"),
        ({"percent": 10, "window": "ten minutes"}, "for", "--for: 'ten minutes' is not a duration"),
        ({"percent": 10, "window": 600}, "for", "--for: write a duration with its unit"),
        ({"percent": 10, "window": "9" * 5000 + "s"}, "for", "is not a duration"),
        ({"percent": 10, "max_error_rate": 1}, "max_error_rate", "from 0 up to (not including) 1"),
        ({"percent": 10, "max_error_rate": -0.1}, "max_error_rate", "(got -0.1)"),
        ({"percent": 10, "max_error_rate": float("nan")}, "max_error_rate", "(got nan)"),
        ({"percent": 10, "max_error_rate": "0.1"}, "max_error_rate", "(got '0.1')"),
        ({"percent": 10, "max_latency_ratio": 0.5}, "max_latency_ratio", "from 1 to 100 (got 0.5)"),
        ({"percent": 10, "max_latency_ratio": float("inf")}, "max_latency_ratio", "(got inf)"),
        ({"percent": 10, "max_latency_ratio": 101}, "max_latency_ratio", "(got 101)"),
        ({"percent": 10, "max_latency_ratio": False}, "max_latency_ratio", "(got False)"),
    ],
)
def test_it_refuses_settings_that_make_no_sense(
    given: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(Refused) as refused:
        canary_settings(**given)
    assert refused.value.status == 400 and refused.value.code == "invalid_canary"
    assert says in refused.value.message
    assert [p.field for p in refused.value.problems] == [field]

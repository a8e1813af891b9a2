"""Traffic on the console: a model's charts (last hour, day or week), sparklines for the models
list, the Usage page (requests and tokens per gateway key, model and day, with a CSV link),
and the Nodes page's chart of reserved against capacity.

The figures are the gateway's (access.traffic), read in one query per chart, whatever the
window; the charts are SVG drawn here (console.charts) with the numbers in a table below.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.utils.safestring import SafeString, mark_safe

from access import roles, traffic
from access import selectors as gateway_selectors
from core.actor import Actor
from fleet import capacity as fleet_capacity

from . import charts


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def window_named(name: str) -> traffic.Window:
    """The window asked for; the last hour for anything else."""
    return traffic.WINDOWS.get(name, traffic.WINDOWS["hour"])


def model_traffic(name: str, window: traffic.Window, now: datetime | None = None) -> dict[str, Any]:
    """Charts and the table under them for one model; one query."""
    points = traffic.series([name], window, now=now)[name]
    start, end = traffic.window_bounds(window, now)
    rows: list[dict[str, Any]] = [
        {
            "start": point.start,
            "requests": point.figures.requests,
            "client_errors": point.figures.client_errors,
            "server_errors": point.figures.server_errors,
            "p50_ms": _ms(point.figures.latency(0.5)),
            "p95_ms": _ms(point.figures.latency(0.95)),
            "prompt_tokens": point.figures.prompt_tokens,
            "completion_tokens": point.figures.completion_tokens,
            "tokens_per_second": round(point.tokens_per_second, 2),
            # The step's slowest answer and its request's ID, to follow to its log lines and
            # trace (access.traffic).
            "slowest_seconds": point.figures.slowest_seconds,
            "slowest_request": point.figures.slowest_request,
        }
        for point in points
    ]
    step = f"per {int(window.step.total_seconds() // 60)} min"

    def chart(title: str, *parts: tuple[str, str, str]) -> SafeString:
        return mark_safe(
            charts.line_chart(
                [
                    charts.Series(
                        label,
                        [(r["start"], float(r[key])) for r in rows if r[key] is not None],
                        unit,
                    )
                    for label, key, unit in parts
                ],
                start=start,
                end=end,
                title=title,
            )
        )

    total = traffic.totals(points)
    return {
        "window": window.name,
        "windows": list(traffic.WINDOWS),
        "rows": rows,
        "total": {
            "requests": total.requests,
            "client_errors": total.client_errors,
            "server_errors": total.server_errors,
            "p50_ms": _ms(total.latency(0.5)),
            "p95_ms": _ms(total.latency(0.95)),
            "prompt_tokens": total.prompt_tokens,
            "completion_tokens": total.completion_tokens,
            "slowest_seconds": total.slowest_seconds,
            "slowest_request": total.slowest_request,
        },
        "charts": [
            chart(
                f"Requests {step}",
                ("requests", "requests", ""),
                ("client errors (4xx)", "client_errors", ""),
                ("server errors (5xx)", "server_errors", ""),
            ),
            chart(f"Latency {step}", ("p50", "p50_ms", " ms"), ("p95", "p95_ms", " ms")),
            chart(f"Tokens per second {step}", ("completion tokens/s", "tokens_per_second", "")),
        ],
        "step_minutes": int(window.step.total_seconds() // 60),
    }


def sparklines(names: list[str], now: datetime | None = None) -> dict[str, SafeString]:
    """Requests per minute over the last hour, one small line per model; one query."""
    window = traffic.WINDOWS["hour"]
    start, end = traffic.window_bounds(window, now)
    found = traffic.series(names, window, now=now)
    return {
        name: mark_safe(
            charts.sparkline(
                [(p.start, p.figures.requests) for p in points],
                start=start,
                end=end,
                label=f"{name}: requests per minute",
            )
        )
        for name, points in found.items()
    }


# -- usage ---------------------------------------------------------------------------------


def _since(text: str) -> date | None:
    try:
        return date.fromisoformat(text) if text else None
    except ValueError:
        return None


def usage_context(actor: Actor, query: dict[str, str]) -> dict[str, Any]:
    """The Usage page: the filters as given, their problems, the rows and their totals."""
    default_since = (datetime.now(UTC) - timedelta(days=30)).date()
    filters = {
        "key": query.get("key", "").strip(),
        "model": query.get("model", "").strip()[:200],
        "since": query.get("since", "").strip() or default_since.isoformat(),
    }
    problems = []
    key_id: int | None = None
    if filters["key"]:
        if filters["key"].isdigit():
            key_id = int(filters["key"])
        else:
            problems.append(f"{filters['key']!r} is not a key id; pick one from the list.")
    since = _since(filters["since"])
    if since is None:
        problems.append(f"{filters['since']!r} is not a day; write it as YYYY-MM-DD.")
    rows = gateway_selectors.key_usage(
        actor, key_id=key_id, model=filters["model"] or None, since=since
    )
    given = {k: v for k, v in filters.items() if v}
    return {
        "rows": rows,
        "filters": filters,
        "problems": problems,
        "keys": list(gateway_selectors.keys_visible_to(actor)),
        "totals": {
            "requests": sum(r["requests"] for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
        },
        "csv_url": "/api/v1/usage?" + urlencode({**given, "format": "csv"}),
        "everyone": roles.may(actor, "usage.read-all"),
        # A team admin sees their teams' keys too: whose each one is, as staff do.
        "team_keys": actor.user is not None
        and roles.teams_where(actor.user, "team.usage").exists(),
    }


def capacity_chart(now: datetime | None = None) -> dict[str, Any]:
    """The Nodes page's chart: memory and cores, reserved against capacity, over the last day."""
    now = now or datetime.now(UTC)
    length = timedelta(days=1)
    samples = fleet_capacity.cluster_series(length, now)

    def chart(title: str, reserved: str, capacity: str, unit: str) -> SafeString:
        return mark_safe(  # escaped by console.charts
            charts.line_chart(
                [
                    charts.Series(
                        "capacity", [(s.start, getattr(s, capacity)) for s in samples], unit
                    ),
                    charts.Series(
                        "reserved", [(s.start, getattr(s, reserved)) for s in samples], unit
                    ),
                ],
                start=now - length,
                end=now,
                title=title,
            )
        )

    return {
        "charts": [
            chart("Memory reserved of capacity, GB", "memory_reserved_gb", "memory_gb", " GB"),
            chart("Cores reserved of capacity", "cores_reserved", "cores", ""),
        ],
        # The table under the charts: one row an hour (the last sample of each).
        "rows": list({s.start.replace(minute=0): s for s in samples}.values())[::-1],
        "samples": len(samples),
    }

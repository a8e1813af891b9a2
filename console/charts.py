"""Charts drawn on the server as SVG: no chart library, no script, nothing from a CDN.

A chart is a few series of (time, value) points over a fixed window. Each series is told apart
by its line's dash pattern and its point markers as well as its colour, so it reads without
colour; every point carries a <title> with its numbers (shown on hover), and the page puts the
same numbers in a table under the chart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import escape

WIDTH = 640
HEIGHT = 160
SPARK_WIDTH = 120
SPARK_HEIGHT = 24
MARGIN_LEFT = 48
MARGIN_BOTTOM = 20
MARGIN_TOP = 10
MARGIN_RIGHT = 10

# Dash patterns and markers, in the order series get them.
STYLES = (
    ("", "circle", "series-a"),
    ("6 3", "square", "series-b"),
    ("2 3", "triangle", "series-c"),
    ("8 3 2 3", "diamond", "series-d"),
)


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[datetime, float]]
    unit: str = ""


def _number(value: float) -> str:
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:,.2f}"


def _tick_label(when: datetime, span: timedelta) -> str:
    return when.strftime("%H:%M") if span <= timedelta(days=1) else when.strftime("%a %H:%M")


def _marker(kind: str, x: float, y: float) -> str:
    if kind == "square":
        return f'<rect x="{x - 2.5:.1f}" y="{y - 2.5:.1f}" width="5" height="5"/>'
    if kind == "triangle":
        return f'<polygon points="{x:.1f},{y - 3:.1f} {x - 3:.1f},{y + 2.5:.1f} {x + 3:.1f},{y + 2.5:.1f}"/>'
    if kind == "diamond":
        return f'<polygon points="{x:.1f},{y - 3:.1f} {x - 3:.1f},{y:.1f} {x:.1f},{y + 3:.1f} {x + 3:.1f},{y:.1f}"/>'
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5"/>'


def line_chart(
    series: Sequence[Series], *, start: datetime, end: datetime, title: str, label: str = ""
) -> str:
    """An SVG line chart of `series` between start and end; points are markers joined by lines."""
    span = end - start
    seconds = max(span.total_seconds(), 1.0)
    top = max((v for s in series for _, v in s.points), default=0.0)
    top = top * 1.1 if top > 0 else 1.0
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def x_of(when: datetime) -> float:
        return MARGIN_LEFT + plot_w * (when - start).total_seconds() / seconds

    def y_of(value: float) -> float:
        return MARGIN_TOP + plot_h * (1 - value / top)

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'aria-label="{escape(label or title)}" data-chart="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<line class="axis" x1="{MARGIN_LEFT}" y1="{HEIGHT - MARGIN_BOTTOM}" '
        f'x2="{WIDTH - MARGIN_RIGHT}" y2="{HEIGHT - MARGIN_BOTTOM}"/>',
        f'<line class="axis" x1="{MARGIN_LEFT}" y1="{MARGIN_TOP}" x2="{MARGIN_LEFT}" '
        f'y2="{HEIGHT - MARGIN_BOTTOM}"/>',
        f'<text class="tick" x="{MARGIN_LEFT - 4}" y="{MARGIN_TOP + 8}" '
        f'text-anchor="end">{_number(top)}</text>',
        f'<text class="tick" x="{MARGIN_LEFT - 4}" y="{HEIGHT - MARGIN_BOTTOM}" '
        'text-anchor="end">0</text>',
    ]
    for fraction in (0.0, 0.5, 1.0):
        when = start + span * fraction
        anchor = {0.0: "start", 0.5: "middle", 1.0: "end"}[fraction]
        parts.append(
            f'<text class="tick" x="{x_of(when):.1f}" y="{HEIGHT - 4}" '
            f'text-anchor="{anchor}">{_tick_label(when, span)}</text>'
        )
    for index, one in enumerate(series):
        dash, marker, css = STYLES[index % len(STYLES)]
        points = sorted(one.points)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<g class="series {css}" data-series="{escape(one.label)}">')
        if len(points) > 1:
            path = " ".join(f"{x_of(t):.1f},{y_of(v):.1f}" for t, v in points)
            parts.append(f'<polyline fill="none" points="{path}"{dash_attr}/>')
        for when, value in points:
            x, y = x_of(when), y_of(value)
            hover = f"{one.label} at {when.strftime('%Y-%m-%d %H:%M')}: {_number(value)}{one.unit}"
            parts.append(
                f'<g class="point" data-value="{value}"><title>{escape(hover)}</title>'
                f"{_marker(marker, x, y)}</g>"
            )
        parts.append("</g>")
    # A legend that names each series with its marker, so colour is not needed to tell them apart.
    legend_x = MARGIN_LEFT + 8
    for index, one in enumerate(series):
        _, marker, css = STYLES[index % len(STYLES)]
        y = MARGIN_TOP + 6 + 12 * index
        parts.append(
            f'<g class="legend {css}">{_marker(marker, legend_x, y)}'
            f'<text x="{legend_x + 8}" y="{y + 3}">{escape(one.label)}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def sparkline(
    points: Sequence[tuple[datetime, float]], *, start: datetime, end: datetime, label: str
) -> str:
    """A small line of one series, for a table cell; its <title> says the total."""
    seconds = max((end - start).total_seconds(), 1.0)
    top = max((v for _, v in points), default=0.0) or 1.0
    coords = [
        (
            SPARK_WIDTH * (t - start).total_seconds() / seconds,
            SPARK_HEIGHT - 2 - (SPARK_HEIGHT - 4) * v / top,
        )
        for t, v in sorted(points)
    ]
    total = sum(v for _, v in points)
    body = ""
    if len(coords) > 1:
        body += (
            '<polyline fill="none" points="'
            + " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            + '"/>'
        )
    body += "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5"/>' for x, y in coords)
    text = f"{label}: {_number(total)} in the last hour"
    return (
        f'<svg class="sparkline" role="img" viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" '
        f'width="{SPARK_WIDTH}" height="{SPARK_HEIGHT}" aria-label="{escape(text)}" '
        f'data-points="{len(coords)}"><title>{escape(text)}</title>{body}</svg>'
    )

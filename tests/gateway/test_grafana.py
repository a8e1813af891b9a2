"""The Grafana dashboard in contrib/ asks only for metrics the gateway's /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from core.metrics import control_metrics
from gateway.metrics import (
    ControlPlaneFigures,
    control_plane_exposition,
    exposition,
    metrics,
    model_exposition,
)
from tests.gateway.fake_engine import FakeEngine

DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "llmgw-gateway.json"


def queries(dashboard: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def test_every_metric_the_dashboard_names_is_exported(
    gw: Any, catalog: Any, engine: FakeEngine, other_engine: FakeEngine
) -> None:
    # Traffic that sets every series: answers, a fallback, tokens.
    catalog.add("backup")
    catalog.replica("backup", other_engine)
    catalog.add("chat", fallbacks=["backup"])
    assert gw.post("/v1/completions", {"model": "backup", "prompt": "a"}).status_code == 200
    assert gw.post("/v1/completions", {"model": "chat", "prompt": "a"}).status_code == 200
    text = exposition()[0].decode()
    exported = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
    assert "llmgw_gateway_fallbacks_total" in exported
    # Series that no request above set (retries) are exported as soon as one happens: their
    # sample names follow from the metric's kind.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in [*metrics().registry.collect(), *control_metrics().registry.collect()]:
        exported.update(family.name + end for end in suffixes.get(family.type, ("",)))
    # Written at the scrape from the database and the engines' reports (gateway.app).
    written = model_exposition([]) + control_plane_exposition(ControlPlaneFigures({}, {}))
    exported.update(re.findall(r"^# TYPE (\w+) gauge$", written.decode(), re.M))

    dashboard = json.loads(DASHBOARD.read_text())
    named = {name for expr in queries(dashboard) for name in re.findall(r"\bllmgw_\w+", expr)}
    assert len(named) >= 6
    missing = sorted(named - exported)
    assert not missing, f"the dashboard asks for metrics the gateway does not export: {missing}"


def test_the_dashboard_is_complete_enough_to_import() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            # Balanced brackets: a typo here is a panel that shows nothing.
            for opening, closing in ("()", "{}", "[]"):
                assert target["expr"].count(opening) == target["expr"].count(closing), target

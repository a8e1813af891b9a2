"""`llmgw ctl model traffic NAME` against a running server: the gateway's figures for a model,
its fair queue's among them."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from access.traffic import TrafficBook
from tests.factories import definition
from tests.support.ctl import Ctl, ctl_as

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(live_server.url, tokens, capsys, monkeypatch)


@pytest.fixture
def chat(users: dict[str, Any]) -> str:
    from catalog.definitions import clean_definition
    from catalog.services import model_add
    from core.actor import Actor

    model_add(
        actor=Actor.for_user(users["alice"], "api"),
        definition=clean_definition(definition("chat")),
        source_check=False,
    )
    return "chat"


def columns(header: str, row: str) -> dict[str, str]:
    """A table row's cells by their column's name (columns start where their names do)."""
    names = list(re.finditer(r"\S+(?: \S+)*", header))
    ends = [name.start() for name in names[1:]] + [len(row)]
    return {
        name.group(): row[name.start() : end].strip() for name, end in zip(names, ends, strict=True)
    }


def test_it_prints_the_figures_and_the_queue(ctl: Ctl, chat: str) -> None:
    book = TrafficBook("w1")
    moment = datetime.now(UTC) - timedelta(minutes=2)
    at = moment.timestamp()
    for _ in range(3):
        book.record(
            model="chat", key_id=None, status=200, seconds=0.3, prompt=2, completion=4, at=at
        )
    # The one that timed out, the slowest of the minute.
    book.record(model="chat", key_id=None, status=503, seconds=30, at=at, request_id="req-slow-1")
    for seconds, outcome in ((0.5, "served"), (2.25, "served"), (30.0, "timeout"), (0, "full")):
        book.record_wait(model="chat", seconds=seconds, outcome=outcome, at=at)
    book.flush()

    code, out, err = ctl("bob", "model", "traffic", "chat")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "chat through the gateway in the last hour:"
    assert lines[1] == (
        "  4 requests, 0 client errors (4xx), 1 server error (5xx), latency p50 417 ms, p95 26.00 s"
    )
    assert lines[2] == "  6 prompt and 12 completion tokens"
    assert lines[3] == "  slowest request: 30.00 s, ID req-slow-1"
    assert lines[4] == (
        "    (its log lines: grep the ID in var/log/; its trace: search llmgw.request_id in your "
        "tracing backend)"
    )
    assert lines[5] == (
        "  queue: 3 requests waited for a free slot (mean 10.92 s, longest 30.00 s); "
        "1 timed out (503), 1 refused as the queue was full (429)"
    )
    assert lines[6] == "  waiting for a free slot now: 0"
    assert lines[7] == "  a row is 1 minute (UTC)"
    header, row = lines[9:]
    assert columns(header, row) == {
        "FROM (UTC)": moment.strftime("%Y-%m-%d %H:%M"),
        "REQUESTS": "4",
        "4XX": "0",
        "5XX": "1",
        "P50": "417 ms",
        "P95": "26.00 s",
        "PROMPT TOKENS": "6",
        "COMPLETION TOKENS": "12",
        "QUEUED": "3",
        "QUEUE MEAN": "10.92 s",
        "QUEUE MAX": "30.00 s",
        "TIMED OUT": "1",
        "QUEUE FULL": "1",
        "SLOWEST": "30.00 s",
        "SLOWEST REQUEST": "req-slow-1",
    }

    code, out, _ = ctl("alice", "model", "traffic", "chat", "--window", "week", "--json")
    view = json.loads(out)
    assert (view["window"], view["step_seconds"]) == ("week", 3600)
    assert view["total"]["queued"] == 3
    assert view["total"]["queue_seconds_max"] == 30.0
    assert view["total"]["queue_seconds_mean"] == pytest.approx(32.75 / 3)
    assert (view["total"]["slowest_seconds"], view["total"]["slowest_request"]) == (
        30.0,
        "req-slow-1",
    )
    assert view["points"][0]["slowest_request"] == "req-slow-1"


def test_a_model_without_traffic_says_so(ctl: Ctl, chat: str) -> None:
    code, out, _ = ctl("alice", "model", "traffic", "chat", "--window", "day")
    assert code == 0
    assert out.splitlines() == [
        "chat through the gateway in the last day:",
        "  no requests (the gateway writes its figures every few seconds)",
        "  queue: no request waited for a free slot; 0 timed out (503), 0 refused as the queue "
        "was full (429)",
        "  waiting for a free slot now: 0",
    ]


def test_its_refusals(ctl: Ctl, chat: str, capsys: Any) -> None:
    code, _, err = ctl("alice", "model", "traffic", "chatt")
    assert code != 0
    assert "chatt" in err and "chat" in err
    with pytest.raises(SystemExit) as refused:
        ctl("alice", "model", "traffic", "chat", "--window", "month")
    assert refused.value.code == 2
    assert "invalid choice: 'month'" in capsys.readouterr().err

"""`llmgw ctl usage` against a running server, after requests through the running gateway."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from access import traffic
from gateway.asgi import application
from llmgw.cli import main
from tests.gateway.conftest import GatewayServer
from tests.gateway.fake_engine import FakeEngine

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def front(live_server: Any, settings: Any) -> Iterator[GatewayServer]:
    settings.LLMGW_GATEWAY_FORWARD_TO = live_server.url
    running = GatewayServer(lifespan=True)
    yield running
    running.stop()


def ctl(monkeypatch: Any, capsys: Any, url: str, token: str, *argv: str) -> tuple[int, str]:
    monkeypatch.setenv("LLMGW_URL", url)
    monkeypatch.setenv("LLMGW_TOKEN", token)
    capsys.readouterr()
    code = main(["ctl", *argv])
    out, err = capsys.readouterr()
    return code, out + err


def test_usage_totals_are_what_was_sent(
    front: GatewayServer,
    catalog: Any,
    engine: FakeEngine,
    keys: dict[str, str],
    tokens: dict[str, str],
    monkeypatch: Any,
    capsys: Any,
) -> None:
    assert application.gateway is not None  # the one the lifespan made
    monkeypatch.setattr(application.gateway.state, "book", traffic.TrafficBook("test"))
    catalog.add("chat")
    catalog.replica("chat", engine)
    client = OpenAI(base_url=f"{front.url}/v1", api_key=keys["alice"], max_retries=0)
    for _ in range(3):
        answer = client.completions.create(model="chat", prompt="a")
        assert answer.usage is not None and answer.usage.completion_tokens == 5
    application.gateway.book.flush()

    code, out = ctl(monkeypatch, capsys, front.url, tokens["alice"], "usage")
    assert code == 0, out
    total = re.search(r"^total\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert total is not None, out
    assert total.groups() == ("3", "9", "15")
    assert "alice's app" in out

    code, out = ctl(monkeypatch, capsys, front.url, tokens["bob"], "usage")
    assert code == 0 and "No usage recorded" in out  # bob sees only his own keys

    with pytest.raises(SystemExit) as refused:
        ctl(monkeypatch, capsys, front.url, tokens["alice"], "usage", "--since", "monday")
    assert refused.value.code == 2
    assert "'monday' is not a day; write it as YYYY-MM-DD" in capsys.readouterr().err

"""The list of /v1/ endpoints (gateway.endpoints) and the code made from it, held together: each
endpoint is routed, checked, traced, named in the 404, and served by the engine as started."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway import relay, validate
from gateway.app import Application
from gateway.endpoints import ENDPOINTS, Endpoint, served
from gateway.prefix import prompt_text
from gateway.process import Gateway
from gateway.state import GatewayState
from llmgw.engine import EngineSettings, engine_command
from tests.gateway.fake_engine import FakeEngine

RELAYED = [e for e in ENDPOINTS if e.relayed]


def test_it_routes_every_endpoint_and_nothing_else() -> None:
    assert list(relay.ROUTES) == [e.path for e in ENDPOINTS]
    assert len({e.name for e in ENDPOINTS}) == len(ENDPOINTS)  # one label each in /metrics
    for endpoint in ENDPOINTS:
        assert relay.ROUTES[endpoint.path] == relay.Route(endpoint), endpoint.path


@pytest.mark.parametrize("endpoint", RELAYED, ids=lambda e: e.path)
def test_each_relayed_endpoint_checks_its_body_and_has_a_trace_name(endpoint: Endpoint) -> None:
    assert endpoint.rules is not None and endpoint.rules.__module__ == validate.__name__
    # Its rules are its own: a body with nothing but a model is refused, naming what is missing.
    refused = validate.refusal(endpoint.rules, {"model": "m"})
    assert refused is not None and refused.status == 400
    assert endpoint.operation  # gen_ai.operation.name
    assert endpoint.method == "POST"  # a body names the model


def test_the_404_names_every_endpoint() -> None:
    application = Application()
    application.gateway = Gateway(state=GatewayState())
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/nope", "headers": []}
    asyncio.run(application(scope, receive, send))
    assert sent[0]["status"] == 404
    message = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["message"]
    assert message == (
        "There is no endpoint /v1/nope. The gateway serves GET /v1/models, POST "
        "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/messages, "
        "/v1/rerank and /v1/messages/count_tokens."
    )
    assert all(e.path in message for e in ENDPOINTS)


def test_served_names_each_method_where_it_starts() -> None:
    listed = (
        Endpoint("/v1/a", "a", method="GET"),
        Endpoint("/v1/b", "b"),
        Endpoint("/v1/c", "c"),
        Endpoint("/v1/d", "d", method="GET"),
    )
    assert served(listed) == "GET /v1/a, POST /v1/b, /v1/c and GET /v1/d"
    assert served(listed[:1]) == "GET /v1/a"


def test_the_engine_is_started_with_every_feature_an_endpoint_needs() -> None:
    """Every model's engines compute embeddings, a reranker's rank documents instead (one
    pooling or the other): each endpoint's feature is on the command line of the engines the
    gateway sends it to (routing.Entry.serves)."""
    from dataclasses import replace

    from gateway.routing import Entry

    settings = EngineSettings(
        model_path="m.gguf", model_alias="m", host="127.0.0.1", port=8080, context_length=512
    )
    needed = {e.needs for e in ENDPOINTS if e.needs is not None}
    assert needed == {"embeddings", "reranking"}
    plain = Entry("m", "m", False, False, False, (), 0, None, 0)
    for entry in (plain, replace(plain, reranking=True)):
        command = engine_command(replace(settings, reranking=entry.reranking), "llama-server")
        for feature in needed:
            assert (f"--{feature}" in command) == entry.serves(feature), (entry, feature)


def test_an_endpoint_added_to_the_list_is_served_with_nothing_else_changed(
    gw: Any, catalog: Any, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A throwaway endpoint, declared here only: routed, its body checked by its rules, its
    answer's tokens read by its own reader and counted under its name."""
    echo = Endpoint(
        "/v1/echo",
        "echo",
        rules=validate.completions,
        operation="text_completion",
        prompt=prompt_text,
        usage=lambda answer: (7, 11),
    )
    monkeypatch.setattr(relay, "ROUTES", relay.routes((*ENDPOINTS, echo)))
    catalog.add("chat")
    catalog.replica("chat", engine)

    answer = gw.post("/v1/echo", {"model": "chat", "prompt": "a"})
    assert answer.status_code == 200, answer.text
    assert engine.requests == [("/v1/echo", {"model": "chat", "prompt": "a"})]

    refused = gw.post("/v1/echo", {"model": "chat"})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "prompt"
    assert len(engine.requests) == 1  # the engine never saw the bad body

    text = gw.get("/metrics").text
    assert (
        'llmgw_gateway_requests_total{answered_by="chat",endpoint="echo",model="chat",status="200"} 1.0'
        in text
    )
    assert 'llmgw_gateway_tokens_total{kind="prompt",model="chat"} 7.0' in text
    assert 'llmgw_gateway_tokens_total{kind="completion",model="chat"} 11.0' in text

"""The /v1/ endpoints against fake engines: routing, streams, fallbacks, waits, errors, metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from catalog.models import Model
from fleet.models import Replica
from gateway import routing
from tests.gateway.fake_engine import FakeEngine
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_it_lists_models_and_adapters_in_openais_shape(gw: Any, catalog: Any) -> None:
    catalog.add("chat", adapters=[{"name": "chat-sql", "source": "http://127.0.0.1:8000/a.gguf"}])
    catalog.add("parked", min_replicas=0, max_replicas=0)
    response = gw.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["parent"]) for m in body["data"]] == [
        ("chat", "model", "alice", None),
        ("chat-sql", "model", "alice", "chat"),
    ]


def test_a_chat_completion_goes_to_a_ready_replica(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    response = gw.post("/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["X-LLMGW-Model"] == "chat"
    assert response.json()["model"] == "chat"
    assert engine.requests == [("/v1/chat/completions", body)]


def test_completions_and_embeddings_pass_through(gw: Any, catalog: Any, engine: FakeEngine) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    assert gw.post("/v1/completions", {"model": "chat", "prompt": "a"}).status_code == 200
    response = gw.post("/v1/embeddings", {"model": "chat", "input": "a"})
    assert response.status_code == 200 and response.json()["data"][0]["embedding"] == [
        0.1,
        0.2,
        0.3,
    ]
    assert [path for path, _ in engine.requests] == ["/v1/completions", "/v1/embeddings"]


def test_a_stream_is_passed_on_chunk_by_chunk(gw: Any, catalog: Any, engine: FakeEngine) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    engine.delay, engine.events = 0.3, 4
    started = time.monotonic()
    response = gw.post(
        "/v1/completions", {"model": "chat", "prompt": "a", "stream": True}, stream=True
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    arrivals = []
    chunks = []
    for chunk in response.iter_content(chunk_size=None):
        arrivals.append(time.monotonic() - started)
        chunks.append(chunk)
    events = [c for c in chunks if c.startswith(b"data: {")]
    assert len(events) == 4 and chunks[-1] == b"data: [DONE]\r\n\r\n"
    # The first event was handed on long before the engine finished (4 x 0.3 s).
    assert arrivals[0] < 0.6 and arrivals[-1] > 0.9


def test_an_adapter_is_asked_for_by_name_on_its_base_models_replica(
    gw: Any, catalog: Any, engine: FakeEngine, other_engine: FakeEngine
) -> None:
    catalog.add("chat", adapters=[{"name": "chat-sql", "source": "http://127.0.0.1:8000/a.gguf"}])
    catalog.replica("chat", other_engine)  # started before the adapter was added
    catalog.replica("chat", engine, adapters=("chat-sql",))
    for _ in range(3):
        response = gw.post("/v1/completions", {"model": "chat-sql", "prompt": "a"})
        assert response.status_code == 200 and response.headers["X-LLMGW-Model"] == "chat-sql"
    assert engine.names() == ["chat-sql"] * 3 and other_engine.requests == []


def test_the_engine_is_told_which_adapter_to_apply_at_which_scale(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add(
        "chat",
        adapters=[
            {"name": "chat-sql", "source": "http://127.0.0.1:8000/a.gguf", "scale": 0.5},
            {"name": "chat-fr", "source": "http://127.0.0.1:8000/b.gguf"},
        ],
    )
    catalog.replica("chat", engine, adapters=("chat-sql", "chat-fr"), scales=(0.5, 1.0))

    # A client's own "lora" is dropped: it would apply any adapter at any scale.
    own = [{"id": 1, "scale": 9}]
    for name in ("chat-fr", "chat-sql", "chat"):
        response = gw.post("/v1/completions", {"model": name, "prompt": "a", "lora": own})
        assert response.status_code == 200, response.content

    assert [body["lora"] for _, body in engine.requests] == [
        [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}],
        [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}],
        # The base model's requests say "no adapter" too: see llmgw.engine.lora_request.
        [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}],
    ]
    assert engine.names() == ["chat-fr", "chat-sql", "chat"]


def test_a_request_to_an_engine_without_adapters_goes_on_as_it_came(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    gw.post("/v1/completions", {"model": "chat", "prompt": "a", "lora": [{"id": 0, "scale": 1}]})
    gw.post("/v1/completions", {"model": "chat", "prompt": "a"})
    assert [body for _, body in engine.requests] == [
        {"model": "chat", "prompt": "a"},
        {"model": "chat", "prompt": "a"},
    ]


def test_an_unknown_model_gets_404_with_the_names_there_are(gw: Any, catalog: Any) -> None:
    catalog.add("chat")
    catalog.add("embed")
    catalog.add("chat-large")
    response = gw.post("/v1/completions", {"model": "chta", "prompt": "a"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "There is no model named 'chta'. Models you can use, closest first: "
            "chat, chat-large, embed.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
            "request_id": response.headers["X-Request-ID"],
        }
    }


def test_a_body_without_a_model_gets_400(gw: Any, db: Any) -> None:
    response = gw.post("/v1/chat/completions", {"messages": []})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
    response = gw.post("/v1/chat/completions", "not json")
    assert response.status_code == 400


def test_a_fallback_answers_when_the_model_has_no_ready_replica(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("small")
    catalog.add("big", fallbacks=["small"])
    catalog.replica("small", engine)
    response = gw.post("/v1/completions", {"model": "big", "prompt": "a"})
    assert response.status_code == 200
    assert response.headers["X-LLMGW-Model"] == "small"
    assert response.json()["model"] == "small"
    assert engine.names() == ["small"]


def test_a_fallback_whose_engine_does_not_answer_the_endpoint_is_passed_over(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    # vLLM computes no embeddings: "big" would answer chat for "small", not embeddings.
    snapshot = "http://127.0.0.1:8000/mirror/acme/big/0123abc/config.json"
    catalog.add("big", engine="vllm", source=snapshot, files=["model.safetensors"])
    catalog.add("small", fallbacks=["big"])
    catalog.replica("big", engine)
    refused = gw.post("/v1/embeddings", {"model": "small", "input": "a"})
    assert refused.status_code == 503, refused.text
    assert "its fallback (big) cannot answer /v1/embeddings" in refused.json()["error"]["message"]
    assert engine.requests == []  # no engine was asked
    chat = {"model": "small", "messages": [{"role": "user", "content": "hi"}]}
    answered = gw.post("/v1/chat/completions", chat)
    assert answered.status_code == 200, answered.text
    assert answered.headers["X-LLMGW-Model"] == "big"
    assert engine.names() == ["big"]


def test_an_on_demand_model_is_asked_for_and_waited_for(
    gw: Any, catalog: Any, engine: FakeEngine, settings: Any, monkeypatch: Any
) -> None:
    from tests.support.gateway_state import current_state

    settings.LLMGW_GATEWAY_WAIT = 30
    catalog.add("lazy", min_replicas=0, max_replicas=1, idle_timeout="10s")
    current_state().reload()
    answered: list[Any] = []
    waiting = threading.Thread(
        target=lambda: answered.append(
            requests.post(
                f"{gw.url}/v1/completions",
                json={"model": "lazy", "prompt": "a"},
                headers={"Authorization": f"Bearer {gw.key}"},
                timeout=30,
            )
        )
    )
    waiting.start()
    wait_for(
        lambda: (
            current_state().sizes()[0] == 1
        ),  # on-demand models held for writing (gateway.state)
        timeout=10,
        what="the request's demand for lazy noted by the gateway",
    )
    assert not answered  # still waiting
    current_state().flush()  # what the refresher writes: the demand, which wakes the model
    assert Model.objects.get(name="lazy").demand_at is not None
    catalog.replica("lazy", engine)  # the reconciler placed it and the node got it ready
    current_state().reload()
    waiting.join(timeout=10)
    assert answered[0].status_code == 200 and engine.names() == ["lazy"]


def test_it_gives_up_waiting_with_503_and_retry_after(gw: Any, catalog: Any, settings: Any) -> None:
    settings.LLMGW_GATEWAY_WAIT = 0.5
    catalog.add("lazy", min_replicas=0, max_replicas=1)
    started = time.monotonic()
    response = gw.post("/v1/completions", {"model": "lazy", "prompt": "a"})
    assert 0.5 <= time.monotonic() - started < 3
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "10"
    assert response.json()["error"] == {
        "message": "lazy is being started and was not ready in time. "
        "Try again shortly; the Retry-After header says when.",
        "type": "server_error",
        "param": None,
        "code": "model_not_ready",
        "request_id": response.headers["X-Request-ID"],
    }


def test_the_idle_clock_is_written_at_most_every_few_seconds(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("lazy", min_replicas=0, max_replicas=1)
    catalog.replica("lazy", engine)
    assert gw.post("/v1/completions", {"model": "lazy", "prompt": "a"}).status_code == 200
    first = Model.objects.get(name="lazy").demand_at
    assert first is not None
    assert gw.post("/v1/completions", {"model": "lazy", "prompt": "a"}).status_code == 200
    assert Model.objects.get(name="lazy").demand_at == first


@pytest.fixture
def queries_anywhere(monkeypatch: Any) -> list[str]:
    """Every SQL statement run, from any thread (the gateway's included)."""
    from django.db.backends import utils

    seen: list[str] = []
    execute = utils.CursorWrapper.execute

    def counting(self: Any, sql: str, params: Any = None) -> Any:
        seen.append(f"{threading.current_thread().name}: {sql}")
        return execute(self, sql, params)

    monkeypatch.setattr(utils.CursorWrapper, "execute", counting)
    return seen


def test_a_request_reads_nothing_from_the_database(
    gw: Any, catalog: Any, engine: FakeEngine, queries_anywhere: list[str]
) -> None:
    from tests.support.gateway_state import current_state

    catalog.add("chat", fallbacks=[])
    catalog.add("big", fallbacks=["chat"])
    catalog.replica("chat", engine)
    current_state().reload()
    queries_anywhere.clear()
    for name in ("chat", "big", "chat", "big"):
        response = requests.post(
            f"{gw.url}/v1/completions",
            json={"model": name, "prompt": "a"},
            headers={"Authorization": f"Bearer {gw.key}"},
            timeout=10,
        )
        assert response.status_code == 200
    assert queries_anywhere == []


def test_a_replica_that_refuses_the_connection_is_skipped_once(
    gw: Any, catalog: Any, engine: FakeEngine, process_gateway: Any
) -> None:
    from tests.gateway.test_routing import closed_port

    catalog.add("chat")
    dead = catalog.replica("chat", closed_port())
    alive = catalog.replica("chat", engine)
    # Make the dead one the least busy, so that it is tried first.
    balancer = process_gateway.balancer
    busy = balancer.choose(
        [c for c in routing.read_replicas()["chat"] if c.id == str(alive.pk)], "chat"
    )
    response = gw.post("/v1/completions", {"model": "chat", "prompt": "a"})
    balancer.release(busy)
    assert response.status_code == 200 and len(engine.requests) == 1
    assert balancer.in_flight(str(dead.pk)) == 0
    metrics = gw.get("/metrics").text
    assert 'llmgw_gateway_retries_total{model="chat"} 1.0' in metrics


def test_a_replica_failing_without_a_retry_gets_502(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    engine.mode = "reset"
    response = gw.post("/v1/completions", {"model": "chat", "prompt": "a"})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "replica_unreachable"


def test_an_engine_error_is_passed_on_and_logged_with_the_request_id(
    gw: Any, catalog: Any, engine: FakeEngine, caplog: Any
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    engine.mode = "error"
    with caplog.at_level("WARNING", logger="llmgw.gateway"):
        response = gw.post("/v1/completions", {"model": "chat", "prompt": "a"})
    assert response.status_code == 500 and response.json() == {"detail": "the engine fell over"}
    request_id = response.headers["X-Request-ID"]
    assert len(request_id) == 32  # none was sent: a new one (core.requestid)
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1
    assert "answered 500" in logged[0] and "the engine fell over" in logged[0]


def test_withdrawn_and_failed_replicas_get_nothing(
    gw: Any, catalog: Any, engine: FakeEngine, other_engine: FakeEngine
) -> None:
    from django.utils import timezone

    catalog.add("chat")
    catalog.replica("chat", other_engine, state=Replica.FAILED)
    withdrawn = catalog.replica("chat", other_engine)
    Replica.objects.filter(pk=withdrawn.pk).update(withdrawn_at=timezone.now())
    catalog.replica("chat", engine)
    for _ in range(4):
        assert gw.post("/v1/completions", {"model": "chat", "prompt": "a"}).status_code == 200
    assert len(engine.requests) == 4 and other_engine.requests == []


def test_metrics_count_requests_tokens_and_in_flight(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    gw.post("/v1/completions", {"model": "chat", "prompt": "a"})
    engine.delay = 0.2  # so that the stream is still going when /metrics is read
    streamed = gw.post(
        "/v1/completions", {"model": "chat", "prompt": "a", "stream": True}, stream=True
    )
    during = gw.get("/metrics").text
    b"".join(streamed.iter_content(chunk_size=None))
    gw.post("/v1/completions", {"model": "nope", "prompt": "a"})
    text = gw.get("/metrics").text
    assert 'llmgw_gateway_requests_in_flight{model="chat"} 1.0' in during
    assert 'llmgw_gateway_requests_in_flight{model="chat"} 0.0' in text
    assert (
        'llmgw_gateway_requests_total{answered_by="chat",endpoint="completions",model="chat",status="200"} 2.0'
        in text
    )
    assert (
        'llmgw_gateway_requests_total{answered_by="",endpoint="completions",model="unknown",status="404"} 1.0'
        in text
    )
    assert 'llmgw_gateway_tokens_total{kind="prompt",model="chat"} 3.0' in text
    assert 'llmgw_gateway_tokens_total{kind="completion",model="chat"} 9.0' in text  # 5 + 4
    assert (
        'llmgw_gateway_request_duration_seconds_count{endpoint="completions",model="chat"} 2.0'
        in text
    )


WORKER = """
import os, sys
import django
os.environ["DJANGO_SETTINGS_MODULE"] = "llmgw_site.settings"
django.setup()
from gateway.metrics import metrics, exposition
board = metrics()
if sys.argv[1] == "count":
    board.requests.labels("chat", "chat", "completions", "200").inc()
    board.in_flight.labels("chat").inc()  # and exit with it still up
else:
    sys.stdout.write(exposition()[0].decode())
"""


def test_metrics_add_up_across_worker_processes(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("LLMGW", "PROMETHEUS"))},
        "LLMGW_METRICS_DIR": str(tmp_path / "metrics"),
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
    }

    def run(what: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", WORKER, what],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    run("count")
    run("count")
    text = run("show")
    assert (
        'llmgw_gateway_requests_total{answered_by="chat",endpoint="completions",model="chat",status="200"} 2.0'
        in text
    )
    # The workers that counted are gone: what they had in flight is no longer in flight.
    assert 'llmgw_gateway_requests_in_flight{model="chat"} 1.0' not in text


# -- hostile bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (
            b'{"model": "chat", "max_tokens": ' + b"9" * 5000 + b"}",
            "digits is larger than any field takes (at most 40)",
        ),
        (
            b'{"model": "chat", "n": -' + b"1" * 41 + b"}",
            "digits is larger than any field takes (at most 40)",
        ),
        (b'{"model": "chat", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"model": "chat", "x": ' + b"[" * 65 + b"]" * 65 + b"}", "nested too deeply"),
        (b'{"model": "chat", "temperature": NaN}', "NaN is not a number JSON allows"),
        (b"\xff\xfe not utf-8", "not JSON"),
    ],
)
def test_a_hostile_body_gets_a_400_saying_what_is_wrong(
    gw: Any, catalog: Any, engine: FakeEngine, raw: bytes, says: str
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    response = gw.post("/v1/chat/completions", raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert says in error["message"]
    assert engine.requests == []


def test_a_body_nested_as_deep_as_real_requests_passes(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    messages = [{"role": "user", "content": [{"type": "text", "text": str(i)}]} for i in range(200)]
    response = gw.post("/v1/chat/completions", {"model": "chat", "messages": messages})
    assert response.status_code == 200


def test_a_body_too_large_gets_413(gw: Any, catalog: Any, settings: Any) -> None:
    catalog.add("chat")
    response = gw.post(
        "/v1/chat/completions", b'{"model": "chat", "x": "' + b"a" * 2_000_000 + b'"}'
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


# -- a model that fits nowhere ------------------------------------------------------------------


def test_an_on_demand_model_that_fits_no_node_gets_503_at_once(
    gw: Any, catalog: Any, settings: Any
) -> None:
    settings.LLMGW_GATEWAY_WAIT = 30
    catalog.add(
        "huge",
        min_replicas=0,
        max_replicas=1,
        profiles=[{"name": "cpu", "memory_gb": 64, "cores": 4}],
    )
    started = time.monotonic()
    response = gw.post("/v1/completions", {"model": "huge", "prompt": "a"})
    assert time.monotonic() - started < 2
    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        "huge cannot be started: it fits on no node: its profiles need cpu: 64 GB, 4 cores, "
        "and the largest node has 16 GB and 8 cores. Add a node that is large enough, or give "
        "the model a smaller profile (`llmgw ctl model resources huge`)."
    )


# -- /metrics needs a token, unless it is left open deliberately -------------------------------


def test_metrics_are_closed_without_a_token_or_the_setting_to_leave_them_open(
    gw: Any, settings: Any
) -> None:
    settings.LLMGW_METRICS_OPEN = False
    response = gw.get("/metrics", key="")
    assert response.status_code == 403
    assert "set LLMGW_METRICS_TOKEN" in response.json()["error"]["message"]


def test_metrics_with_a_scrape_token(gw: Any, settings: Any) -> None:
    settings.LLMGW_METRICS_OPEN = False
    settings.LLMGW_METRICS_TOKEN = "scrape-secret"
    assert gw.get("/metrics", key="").status_code == 401
    assert gw.get("/metrics", key="wrong").status_code == 401
    response = gw.get("/metrics", key="scrape-secret")
    assert response.status_code == 200 and "llmgw_gateway" in response.text


# -- the Responses and Messages APIs take the same path -------------------------------------------

OTHER_APIS = [
    ("/v1/responses", {"input": "a", "max_output_tokens": 4}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "a"}]}),
]


@pytest.mark.parametrize(("path", "body"), OTHER_APIS, ids=[p for p, _ in OTHER_APIS])
def test_the_other_apis_are_routed_retried_and_fall_back_as_chat_is(
    gw: Any,
    catalog: Any,
    engine: FakeEngine,
    process_gateway: Any,
    path: str,
    body: dict[str, Any],
) -> None:
    from tests.gateway.test_routing import closed_port

    catalog.add("small")
    catalog.add("big", fallbacks=["small"])
    catalog.replica("small", closed_port())  # refuses: the request goes to the other
    alive = catalog.replica("small", engine)
    # The live one busy, so that the dead one is tried first.
    balancer = process_gateway.balancer
    busy = balancer.choose(
        [c for c in routing.read_replicas()["small"] if c.id == str(alive.pk)], "small"
    )
    answer = gw.post(path, {"model": "big", **body})
    balancer.release(busy)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-LLMGW-Model"] == "small"
    # The engine is asked for the name it serves, at the same path, the body otherwise as sent.
    assert engine.requests == [(path, {**body, "model": "small"})]
    assert 'llmgw_gateway_retries_total{model="big"} 1.0' in gw.get("/metrics").text

    engine.mode = "reset"
    broken = gw.post(path, {"model": "small", **body})
    assert broken.status_code == 502
    if path.startswith("/v1/messages"):
        assert broken.json()["error"]["type"] == "api_error"
    else:
        assert broken.json()["error"]["code"] == "replica_unreachable"


def test_a_messages_stream_without_its_start_is_given_one_with_the_prompts_tokens(
    gw: Any, catalog: Any, engine: FakeEngine
) -> None:
    """llama.cpp sends message_start with the first token that has text; a stream whose first
    tokens are parts of a character starts without it. The client gets one, with the prompt's
    tokens as the engine counts them, and the request is charged them."""

    def event(kind: str, **data: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    catalog.add("chat")
    catalog.replica("chat", engine)
    engine.streams["/v1/messages"] = [
        event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        event(
            "content_block_delta", index=0, delta={"type": "text_delta", "text": "\u00e9t\u00e9"}
        ),
        event("content_block_stop", index=0),
        event("message_delta", delta={"stop_reason": "max_tokens"}, usage={"output_tokens": 3}),
        event("message_stop"),
    ]
    engine.answers["/v1/messages/count_tokens"] = {"input_tokens": 42}
    body = {
        "model": "chat",
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    answer = gw.post("/v1/messages", body)
    assert answer.status_code == 200
    events = [
        json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")
    ]
    assert [e["type"] for e in events][:2] == ["message_start", "content_block_start"]
    assert events[0]["message"]["usage"]["input_tokens"] == 42, engine.requests
    assert events[0]["message"]["model"] == "chat"
    # The engine was asked to count the same body.
    assert engine.requests[-1] == ("/v1/messages/count_tokens", body)
    metrics = gw.get("/metrics").text
    assert 'llmgw_gateway_tokens_total{kind="prompt",model="chat"} 42.0' in metrics
    assert 'llmgw_gateway_tokens_total{kind="completion",model="chat"} 3.0' in metrics

"""End to end: the official `openai` client against the gateway of a whole llmgw (gunicorn with two
worker processes, a Celery worker with beat, two node agents) serving tiny models on the real
llama.cpp server, all as processes on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from llmgw.engine import find_engine
from llmgw.tinygguf import EOS_ID, write_lora_adapter, write_tiny_model
from tests.support.http_files import serve_directory
from tests.support.system import System, wait_for
from tests.support.waiting import stays

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("openai") is None, reason="openai is not installed"
    ),
]

PROFILE = [{"name": "cpu", "memory_gb": 1, "cores": 1}]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("weights")
    write_tiny_model(folder / "tiny.gguf", seed=1)
    write_tiny_model(folder / "other.gguf", seed=2)
    write_lora_adapter(folder / "sql.gguf", seed=3)
    with serve_directory(folder) as (base_url, _stats):
        yield base_url


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, weights: str) -> Iterator[System]:
    folder = tmp_path_factory.mktemp("system")
    running = System(folder, allowed_hosts=[urlsplit(weights).netloc])
    # Until System sets them itself: metrics shared by gunicorn's two workers.
    running.env["LLMGW_METRICS_DIR"] = str(folder / "metrics")
    try:
        running.start()
        running.add_ready_nodes(memory_gb=4, cores=4, names=("node-a", "node-b"))
        add = {
            "chat": {
                "min_replicas": 2,
                "adapters": [{"name": "chat-sql", "source": f"{weights}/sql.gguf"}],
            },
            "big": {"source": f"{weights}/other.gguf", "fallbacks": ["chat"]},
            "lazy": {"min_replicas": 0, "max_replicas": 1, "idle_timeout": "10s"},
            # Room for a long answer: a client hangs up in the middle of one.
            "long": {"context_length": 2048},
        }
        for name, fields in add.items():
            running.api(
                "POST",
                "models",
                json={
                    "name": name,
                    "source": f"{weights}/tiny.gguf",
                    "profiles": PROFILE,
                    **{"context_length": 256, **fields},
                },
            )
        wait_ready(running, "chat", 2)
        wait_ready(running, "big", 1)
        wait_ready(running, "long", 1)
        yield running
    except BaseException:
        print(running.log_tail())
        raise
    finally:
        running.close()


@pytest.fixture(scope="module")
def key(system: System) -> str:
    return system.api("POST", "keys", json={"name": "e2e"})["key"]


@pytest.fixture(scope="module")
def client(system: System, key: str) -> Any:
    import openai

    # No client-side retries: every failed request must count as one.
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key=key, max_retries=0, timeout=120)


def target(system: System, name: str) -> dict[str, Any]:
    return system.api("GET", f"models/{name}/target")


def wait_ready(system: System, name: str, count: int, timeout: float = 90) -> list[dict[str, Any]]:
    def enough() -> list[dict[str, Any]] | None:
        replicas = target(system, name)["replicas"]
        ready = [r for r in replicas if r["routable"]]
        placed = [r for r in replicas if r["state"] != "withdrawn"]
        return ready if len(ready) == count and len(placed) == count else None

    return wait_for(enough, timeout=timeout, what=f"{count} ready replica(s) of {name}")


def chat(client: Any, model: str, **extra: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, **extra
    )


def test_models_lists_models_and_adapters(client: Any) -> None:
    listed = {m.id: m for m in client.models.list()}
    assert {"chat", "chat-sql", "big", "lazy"} <= set(listed)
    assert listed["chat-sql"].model_extra["parent"] == "chat"


def test_chat_completion(client: Any) -> None:
    raw = chat(client, "chat")
    answer = raw.parse()
    assert raw.headers["X-LLMGW-Model"] == "chat"
    assert answer.model == "chat" and answer.choices[0].message.content is not None
    assert answer.usage.completion_tokens > 0


def test_an_engine_answers_only_the_gateway_and_its_agent(system: System, client: Any) -> None:
    """Each replica's engine has a key of its own: a caller that reaches the node's port range
    without it gets 401 for everything but /health, so it cannot get around the gateway's keys,
    limits and usage. The key is in a file only its owner reads, never on a command line."""
    import os
    import stat

    import requests

    replicas = wait_ready(system, "chat", 2)
    keys = set()
    for replica in replicas:
        engine_url = f"http://127.0.0.1:{replica['port']}"
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for method, path in [
            ("POST", "/v1/chat/completions"),
            ("POST", "/completion"),
            ("GET", "/slots"),
            ("GET", "/metrics"),
            ("GET", "/props"),
            ("GET", "/v1/models"),
        ]:
            answer = requests.request(method, f"{engine_url}{path}", json=body, timeout=10)
            assert answer.status_code == 401, (path, answer.status_code, answer.text[:200])
        wrong = {"Authorization": "Bearer " + "0" * 64}
        answer = requests.post(
            f"{engine_url}/v1/chat/completions", json=body, headers=wrong, timeout=10
        )
        assert answer.status_code == 401
        assert requests.get(f"{engine_url}/health", timeout=10).status_code == 200
        key = system.engine_key(replica)
        keys.add(key)
        opened = {"Authorization": f"Bearer {key}"}
        answer = requests.post(
            f"{engine_url}/v1/chat/completions", json=body, headers=opened, timeout=30
        )
        assert answer.status_code == 200, answer.text[:200]
        folder = system.folder / "nodes" / replica["node"] / "replicas" / replica["id"]
        assert stat.S_IMODE(os.stat(folder / "engine.key").st_mode) == 0o600
        state = json.loads((folder / "state.json").read_text())
        assert (
            key not in " ".join(state["command"]) and key not in (folder / "state.json").read_text()
        )
        cmdline = Path(f"/proc/{state['pid']}/cmdline").read_bytes().decode()
        assert key not in cmdline and "--api-key-file" in cmdline
    assert len(keys) == 2  # one key per replica
    # The gateway sends the key: its requests are answered.
    assert chat(client, "chat").parse().choices[0].message.content is not None


def test_streaming_arrives_as_several_events(client: Any) -> None:
    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        stream=True,
        # No early end: a tiny random model may otherwise stop after a token or two.
        extra_body={"logit_bias": [[EOS_ID, False]]},
    )
    chunks = list(stream)
    assert len(chunks) >= 4
    assert all(c.model == "chat" for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def test_completion_and_embeddings(client: Any) -> None:
    answer = client.completions.create(model="chat", prompt="hello", max_tokens=4)
    assert answer.model == "chat" and isinstance(answer.choices[0].text, str)
    embedding = client.embeddings.create(model="chat", input="hello")
    assert embedding.model == "chat" and len(embedding.data) == 1


def test_an_adapter_by_name(client: Any) -> None:
    for _ in range(2):
        raw = chat(client, "chat-sql")
        assert raw.headers["X-LLMGW-Model"] == "chat-sql"
        assert raw.parse().model == "chat-sql"
    # The base model still answers as itself on the same replicas.
    assert chat(client, "chat").parse().model == "chat"


def test_an_unknown_model_is_a_404_naming_the_close_ones(client: Any) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as caught:
        chat(client, "chta")
    assert "There is no model named 'chta'. Models you can use, closest first: chat," in str(
        caught.value
    )


def test_an_on_demand_model_wakes_on_its_first_request_and_sleeps_when_idle(
    system: System, client: Any
) -> None:
    assert target(system, "lazy")["replicas"] == []
    started = time.monotonic()
    raw = chat(client, "lazy")
    woke_in = time.monotonic() - started
    assert raw.headers["X-LLMGW-Model"] == "lazy" and raw.parse().model == "lazy"
    assert [r["routable"] for r in target(system, "lazy")["replicas"]] == [True]
    for _ in range(3):  # while it is used, it stays: time is what is tested
        stays(
            lambda: [r["routable"] for r in target(system, "lazy")["replicas"]] == [True],
            seconds=2,
            interval=0.5,
            what="lazy's one replica, in use, ready",
        )
        chat(client, "lazy")
    print(f"lazy woke in {woke_in:.1f}s")
    # Idle for 10s: withdrawn, drained, stopped.
    wait_for(
        lambda: target(system, "lazy")["replicas"] == [],
        timeout=45,
        interval=0.5,
        what="the idle on-demand model to stop",
    )


def test_a_client_that_hangs_up_mid_stream_stops_the_engine_within_a_second(
    system: System, key: str
) -> None:
    import http.client
    import json

    import requests

    replica = wait_ready(system, "long", 1)[0]
    engine_url = f"http://127.0.0.1:{replica['port']}"
    opened = {"Authorization": f"Bearer {system.engine_key(replica)}"}
    if requests.get(f"{engine_url}/health", timeout=5).status_code != 200:
        # llama-cpp-python's server keeps generating (and soon hangs) after its client left,
        # whoever that client is; llama.cpp's llama-server stops at once and says so in /slots.
        pytest.skip("the engine is not llama-server: it cannot show that it stopped")
    gateway = http.client.HTTPConnection("127.0.0.1", system.port, timeout=30)
    body = {
        "model": "long",
        "prompt": "hello",
        "max_tokens": 1900,
        "stream": True,
        "logit_bias": [[EOS_ID, False]],  # no early end: the engine would go on for seconds
    }
    gateway.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    response = gateway.getresponse()
    assert response.status == 200
    events = 0
    while events < 3:
        events += response.readline().startswith(b"data: {")

    def generating() -> bool:
        slots = requests.get(f"{engine_url}/slots", headers=opened, timeout=5).json()
        return any(slot.get("is_processing") for slot in slots)

    assert generating()
    gateway.close()  # the client hangs up
    hung_up = time.monotonic()
    wait_for(
        lambda: not generating(),
        timeout=1.0,
        interval=0.02,
        what="the engine to stop generating once the client hung up",
    )
    print(f"the engine stopped {time.monotonic() - hung_up:.3f}s after the client hung up")


def test_a_fallback_answers_when_the_model_is_scaled_to_zero(system: System, client: Any) -> None:
    assert chat(client, "big").headers["X-LLMGW-Model"] == "big"
    system.api("POST", "models/big/scale", json={"min": 0})
    wait_for(
        lambda: all(r["state"] == "withdrawn" for r in target(system, "big")["replicas"]),
        timeout=30,
        what="big's replica to be withdrawn",
    )
    # The gateway learns of the withdrawal from the database's change notification: within a
    # poll (50 ms on SQLite; at once on PostgreSQL), well inside the replica's drain, during which
    # a request still sent to it is answered.
    answers: list[Any] = []

    def answered_by_the_fallback() -> bool:
        answers.append(chat(client, "big"))
        return answers[-1].headers["X-LLMGW-Model"] == "chat"

    wait_for(
        answered_by_the_fallback,
        timeout=1.0,
        interval=0.05,
        what="a request for big answered by its fallback, chat",
    )
    assert answers[-1].parse().model == "chat"


def test_a_rolling_restart_under_load_fails_no_request(system: System, client: Any) -> None:
    before = {r["id"] for r in wait_ready(system, "chat", 2)}
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def load(streaming: bool) -> None:
        while not stop.is_set():
            try:
                if streaming:
                    chunks = list(
                        client.chat.completions.create(
                            model="chat",
                            messages=[{"role": "user", "content": "hello"}],
                            max_tokens=8,
                            stream=True,
                        )
                    )
                    assert chunks and chunks[-1].choices[0].finish_reason is not None
                else:
                    assert chat(client, "chat").parse().choices
            except Exception as exc:  # counted, not raised: the assertion below reports them all
                with lock:
                    outcomes["failed"] += 1
                    failures.append(f"{type(exc).__name__}: {exc}")
            else:
                with lock:
                    outcomes["ok"] += 1

    threads = [threading.Thread(target=load, args=(s,)) for s in (False, False, True)]
    for thread in threads:
        thread.start()
    try:
        wait_for(
            lambda: outcomes["ok"] >= 10 or outcomes["failed"],
            timeout=60,
            interval=0.05,
            what="the load under way (ten answers) before the restart",
        )
        system.api("POST", "models/chat/restart")

        def replaced_and_old_ones_stopped() -> bool:
            replicas = target(system, "chat")["replicas"]
            ids = {r["id"] for r in replicas}
            ready = [r for r in replicas if r["routable"] and r["up_to_date"]]
            return len(ready) == 2 and not ids & before

        wait_for(replaced_and_old_ones_stopped, timeout=90, interval=0.5, what="the restart")
        restarted = outcomes["ok"]
        wait_for(
            lambda: outcomes["ok"] >= restarted + 10 or outcomes["failed"],
            timeout=60,
            interval=0.05,
            what="ten answers from the new replicas alone",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    import requests

    retries = re.findall(
        r"llmgw_gateway_retries_total\{[^}]*\} (\S+)",
        requests.get(f"{system.url}/metrics", timeout=10).text,
    )
    print(f"during the restart: {dict(outcomes)}; requests sent again: {retries}")
    assert outcomes["failed"] == 0, failures[:5]
    assert outcomes["ok"] >= 50


def test_metrics_add_up_across_the_web_workers(system: System, client: Any) -> None:
    import requests

    def total() -> float:
        text = requests.get(f"{system.url}/metrics", timeout=10).text
        pattern = r'llmgw_gateway_requests_total\{answered_by="chat-sql",endpoint="chat",model="chat-sql",status="200"\} ([0-9.e+]+)'
        found = re.search(pattern, text)
        return float(found.group(1)) if found else 0.0

    before = total()
    for _ in range(10):
        chat(client, "chat-sql")
    assert total() == before + 10


def test_the_engines_own_numbers_reach_metrics(system: System, client: Any) -> None:
    import requests

    labels = r'\{model="long",node="node-[ab]",replica="[0-9a-f-]+"\}'

    def figure(text: str, name: str) -> float | None:
        found = re.search(rf"{name}{labels} (\S+)", text)
        return float(found.group(1)) if found else None

    # The same conversation twice: the second prompt comes from the engine's prompt cache.
    for _ in range(2):
        chat(client, "long")

    def reported() -> str | None:
        text = requests.get(f"{system.url}/metrics", timeout=10).text
        cached = figure(text, "llmgw_engine_prompt_tokens_cached_total")
        return text if cached else None

    # The agent reads its engines every 5 s and the heartbeat carries them; the gateway reads
    # the database at least every 5 s.
    text = wait_for(reported, timeout=40, interval=1, what="long's engine numbers in /metrics")
    assert figure(text, "llmgw_engine_slots") == 1
    assert figure(text, "llmgw_engine_slots_busy") == 0
    assert figure(text, "llmgw_engine_requests_waiting") == 0
    assert (figure(text, "llmgw_engine_predicted_tokens_total") or 0) >= 2
    assert (figure(text, "llmgw_engine_prompt_tokens_total") or 0) > (
        figure(text, "llmgw_engine_prompt_tokens_cached_total") or 0
    )
    assert figure(text, "llmgw_engine_tokens_per_second") is not None
    assert "# TYPE llmgw_engine_prompt_tokens_cached_total counter" in text

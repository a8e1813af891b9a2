"""The Responses API and Anthropic's Messages API through the gateway, spoken by their official
clients (the `openai` and `anthropic` SDKs): answers whole and streamed, tokens counted in each
API's own words, refusals in each API's own shape, and what a key's usage figures show.

A gateway process as the run command starts it (two workers) in front of the real llama.cpp
server on a tiny model, on a database of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.engine import running_engine
from tests.support.gateway_processes import serve_chat_with_keys
from tests.support.system import System, wait_for

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]

# Keys, and the fields set on each: one a test, so that what one counts is its own.
KEYS: dict[str, dict[str, Any]] = {
    "responses": {},
    "messages": {},
    "count": {},
    "cut": {},
    "usage": {},
    "mistakes": {},
    "slow-anthropic": {"rpm": 1},
    "slow-openai": {"rpm": 1},
    "tight": {"tpm": 60},
}
HELLO = [{"role": "user", "content": "hello there, how are you today?"}]


@dataclass
class Served:
    system: System
    secrets: dict[str, str]

    @property
    def url(self) -> str:
        return self.system.url

    def openai(self, key: str) -> Any:
        # No client-side retries: every request sent is one the gateway counts.
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.secrets[key], max_retries=0, timeout=60
        )

    def anthropic(self, key: str) -> Any:
        return anthropic.Anthropic(
            base_url=self.url, api_key=self.secrets[key], max_retries=0, timeout=60
        )

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        scraped = requests.get(f"{self.url}/metrics", timeout=10).text
        return [
            (name, dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
            for name, labels, value in re.findall(
                r"^(llmgw_gateway_\w+)\{(.*)\} (\S+)$", scraped, re.MULTILINE
            )
        ]

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens the gateway counted for chat, all workers together."""
        found = {"prompt": 0, "completion": 0}
        for name, labels, value in self.metrics():
            if name == "llmgw_gateway_tokens_total" and labels.get("model") == "chat":
                found[labels["kind"]] += int(value)
        return found["prompt"], found["completion"]

    def requests(self, endpoint: str, status: str = "200") -> int:
        return int(
            sum(
                value
                for name, labels, value in self.metrics()
                if name == "llmgw_gateway_requests_total"
                and labels.get("endpoint") == endpoint
                and labels.get("status") == status
            )
        )

    def rows(self, key: str) -> tuple[int, int, int]:
        """(requests, prompt, completion) in the key's usage rows: what `llmgw ctl usage` and
        the usage CSV add up."""
        script = (
            "from django.db.models import Sum\n"
            "from access.models import GatewayKey, KeyUsageDay\n"
            f"key = GatewayKey.objects.get(name={key!r})\n"
            "sums = KeyUsageDay.objects.filter(key=key).aggregate("
            "r=Sum('requests'), p=Sum('prompt_tokens'), c=Sum('completion_tokens'))\n"
            "print('ROWS', sums['r'] or 0, sums['p'] or 0, sums['c'] or 0)\n"
        )
        printed = self.system.manage("shell", "-c", script).splitlines()
        _, *figures = next(line for line in printed if line.startswith("ROWS")).split()
        requests_, prompt, completion = (int(f) for f in figures)
        return requests_, prompt, completion


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("apis")
    write_tiny_model(folder / "tiny.gguf", seed=1, context_length=8192)
    system = System(folder / "system")
    system.env["LLMGW_LIMITS_REDIS"] = "off"
    try:
        with running_engine(
            folder / "tiny.gguf",
            alias="chat",
            context_length=2048,
            slots=2,
            log=folder / "engine.log",
        ) as engine:
            secrets = serve_chat_with_keys(system, int(engine.rsplit(":", 1)[1]), KEYS)
            yield Served(system, secrets)
    finally:
        system.close()


def first_events(
    served: Served, path: str, body: dict[str, Any], headers: dict[str, str], count: int
) -> list[dict[str, Any]]:
    """A stream's first `count` events, read as a client that then leaves (the connection
    closes with the block)."""
    events: list[dict[str, Any]] = []
    with requests.post(
        f"{served.url}{path}", json=body, headers=headers, stream=True, timeout=60
    ) as cut:
        assert cut.status_code == 200
        for line in cut.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
            if len(events) == count:
                break
    return events


def counted_since(served: Served, before: tuple[int, int], wanted: tuple[int, int]) -> None:
    """Waits until the gateway counted `wanted` more tokens than `before` (a stream is counted
    when it ends, just after the client has read it), and that it stays exactly that."""
    wait_for(
        lambda: tuple(n - b for n, b in zip(served.tokens(), before, strict=True)) == wanted,
        timeout=20,
        what=f"{wanted} tokens counted since {before}; now {served.tokens()}",
    )


# -- the Responses API ------------------------------------------------------------------------


def test_the_openai_sdk_creates_a_response_whole_and_streamed(served: Served) -> None:
    client = served.openai("responses")
    before = served.tokens()
    whole = client.responses.with_raw_response.create(
        model="chat", input="hello there", instructions="Be brief.", max_output_tokens=8
    )
    assert whole.headers["x-llmgw-model"] == "chat"
    assert whole.headers["x-request-id"]
    assert "server" not in whole.headers  # the run command's gateway names no software
    response = whole.parse()
    assert response.status == "completed" and response.model == "chat"
    assert response.output[0].type == "message"
    usage = response.usage
    assert usage.input_tokens > 5 and 1 <= usage.output_tokens <= 8
    counted_since(served, before, (usage.input_tokens, usage.output_tokens))

    before = served.tokens()
    events = list(
        client.responses.create(
            model="chat",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "hi again"}]}],
            max_output_tokens=6,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds
    done = events[-1].response
    assert done.usage.output_tokens == kinds.count("response.output_text.delta") or (
        done.usage.output_tokens >= kinds.count("response.output_text.delta")
    )
    counted_since(served, before, (done.usage.input_tokens, done.usage.output_tokens))
    assert served.requests("responses") >= 2


def test_a_response_the_gateway_cannot_keep_is_refused_saying_why(served: Served) -> None:
    client = served.openai("mistakes")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="chat", input="hi", previous_response_id="resp_123")
    assert "keeps no responses" in refused.value.message
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as stored:
        client.responses.create(model="chat", input="hi", store=True)
    assert stored.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as empty:
        client.responses.create(model="chat", input=[])
    assert empty.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="nope", input="hi")
    assert unknown.value.body["code"] == "model_not_found"


# -- Anthropic's Messages API -------------------------------------------------------------------


def test_the_anthropic_sdk_creates_and_streams_messages(served: Served) -> None:
    client = served.anthropic("messages")
    before = served.tokens()
    raw = client.messages.with_raw_response.create(model="chat", max_tokens=8, messages=HELLO)
    assert raw.headers["x-llmgw-model"] == "chat"
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant" and message.model == "chat"
    assert message.stop_reason in ("max_tokens", "end_turn")
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert prompt > 5 and 1 <= message.usage.output_tokens <= 8
    counted_since(served, before, (prompt, message.usage.output_tokens))

    # Streamed, through the SDK's own accumulator (it checks the events' order), with a
    # system prompt as blocks.
    before = served.tokens()
    with client.messages.stream(
        model="chat",
        max_tokens=6,
        system=[{"type": "text", "text": "You are terse."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "tell me a story"}]}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1
    assert text == "".join(b.text for b in final.content if b.type == "text")
    streamed_prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    counted_since(served, before, (streamed_prompt, final.usage.output_tokens))

    # The key as Claude Code's ANTHROPIC_AUTH_TOKEN sends it: a bearer token.
    bearer = anthropic.Anthropic(
        base_url=served.url, auth_token=served.secrets["messages"], max_retries=0
    )
    assert bearer.messages.create(model="chat", max_tokens=2, messages=HELLO).usage
    # And the model list, as Anthropic's clients read it.
    assert "chat" in [model.id for model in client.models.list()]


def test_every_stream_starts_as_anthropic_clients_require(served: Served) -> None:
    """llama.cpp sends message_start with the first token that has text: a stream whose first
    tokens are parts of a character would start without it. Whatever the tiny model says, each
    stream the gateway relays starts with message_start and ends with message_stop."""
    client = served.anthropic("messages")
    for number in range(24):
        with client.messages.stream(
            model="chat",
            max_tokens=3,
            extra_body={"temperature": 1},  # sampled: the first token may be a byte
            messages=[{"role": "user", "content": f"question number {number}"}],
        ) as stream:
            events = list(stream)
        kinds = [event.type for event in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        # With the prompt's tokens, whoever sent it (the engine, or the gateway for it).
        usage = events[0].message.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 5, usage


def test_counting_tokens_is_no_generation(served: Served) -> None:
    client = served.anthropic("count")
    before, asked_before = served.tokens(), served.requests("count_tokens")
    counted = client.messages.count_tokens(model="chat", messages=HELLO)
    longer = client.messages.count_tokens(
        model="chat", system="You are a very helpful assistant.", messages=HELLO
    )
    assert 5 < counted.input_tokens < longer.input_tokens
    # Counted as requests, not as tokens.
    wait_for(lambda: served.requests("count_tokens") == asked_before + 2, what="two counts")
    assert served.tokens() == before


def test_a_response_stream_cut_short_is_charged_its_prompt(served: Served) -> None:
    client = served.openai("cut")
    whole = client.responses.create(model="chat", input="a long story please", max_output_tokens=1)
    before = served.tokens()
    body = {"model": "chat", "input": "a long story please", "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {served.secrets['cut']}"}
    events = first_events(served, "/v1/responses", body, headers, 5)
    # The gateway's own question to the engine (the prompt's progress) is not in the stream.
    assert all("prompt_progress" not in event for event in events)
    assert events[0]["type"] == "response.created"
    prompt = whole.usage.input_tokens
    wait_for(lambda: served.tokens()[0] - before[0] == prompt, what=f"{prompt} prompt tokens")
    assert 1 <= served.tokens()[1] - before[1] < 2048 / 2


def test_counting_is_limited_by_requests_not_by_tokens(served: Served) -> None:
    """A key allowed 60 tokens a minute spends them on one message; the next is refused, while
    counting a prompt's tokens goes on (a count uses none)."""
    client = served.anthropic("tight")
    # Greedy: a sampled answer of the tiny model may spell out a stop string of its template
    # and end early, with its tokens below the 60 (ignore_eos keeps only the end token away).
    first = client.messages.create(
        model="chat",
        max_tokens=40,
        messages=HELLO,
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    assert first.usage.output_tokens == 40  # with its prompt, past the 60
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(model="chat", max_tokens=4, messages=HELLO)
    assert "60 tokens per minute" in limited.value.body["error"]["message"]
    for _ in range(3):
        assert client.messages.count_tokens(model="chat", messages=HELLO).input_tokens > 5


def test_a_message_stream_cut_short_is_charged_its_prompt(served: Served) -> None:
    before = served.tokens()
    body = {
        "model": "chat",
        "max_tokens": 1500,
        "stream": True,
        "messages": HELLO,
        "ignore_eos": True,
    }
    headers = {"x-api-key": served.secrets["cut"], "anthropic-version": "2023-06-01"}
    events = first_events(served, "/v1/messages", body, headers, 4)
    start = events[0]["message"]["usage"]
    prompt = start["input_tokens"] + start.get("cache_read_input_tokens", 0)
    wait_for(lambda: served.tokens()[0] - before[0] == prompt, what=f"{prompt} prompt tokens")
    assert 2 <= served.tokens()[1] - before[1] < 1500 / 2


def test_anthropic_mistakes_are_400s_in_anthropics_shape(served: Served) -> None:
    headers = {"x-api-key": served.secrets["mistakes"], "anthropic-version": "2023-06-01"}
    answer = requests.post(
        f"{served.url}/v1/messages",
        json={"model": "chat", "messages": HELLO},
        headers=headers,
        timeout=10,
    )
    assert answer.status_code == 400
    assert answer.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "max_tokens is required: the most tokens the answer may have, like 1024.",
        },
        "request_id": answer.headers["x-request-id"],
    }
    client = served.anthropic("mistakes")
    with pytest.raises(anthropic.BadRequestError) as wrong_role:
        client.messages.create(
            model="chat", max_tokens=4, messages=[{"role": "robot", "content": "hi"}]
        )
    assert wrong_role.value.body["error"]["type"] == "invalid_request_error"
    assert "system prompt goes in 'system'" in wrong_role.value.message
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="nope", max_tokens=4, messages=HELLO)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        anthropic.Anthropic(
            base_url=served.url, api_key="llmgw-nope", max_retries=0
        ).messages.create(model="chat", max_tokens=4, messages=HELLO)
    assert bad_key.value.body["error"]["type"] == "authentication_error"


# -- limits and usage ---------------------------------------------------------------------------


def test_past_a_limit_each_api_is_refused_in_its_own_shape(served: Served) -> None:
    claude = served.anthropic("slow-anthropic")
    claude.messages.create(model="chat", max_tokens=2, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as limited:
        claude.messages.create(model="chat", max_tokens=2, messages=HELLO)
    body = limited.value.body
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert (
        "limit of 1 request per minute is reached (1 request in the last minute)"
        in (body["error"]["message"])
    )
    assert int(limited.value.response.headers["retry-after"]) >= 1

    codex = served.openai("slow-openai")
    codex.responses.create(model="chat", input="hi", max_output_tokens=2)
    with pytest.raises(openai.RateLimitError) as refused:
        codex.responses.create(model="chat", input="hi", max_output_tokens=2)
    assert refused.value.body["code"] == "rate_limit_exceeded"
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_a_keys_usage_figures_count_each_api(served: Served) -> None:
    before = served.tokens()
    response = served.openai("usage").responses.create(
        model="chat", input="hello", max_output_tokens=4
    )
    message = served.anthropic("usage").messages.create(model="chat", max_tokens=4, messages=HELLO)
    served.anthropic("usage").messages.count_tokens(model="chat", messages=HELLO)
    prompt = (
        response.usage.input_tokens
        + message.usage.input_tokens
        + (message.usage.cache_read_input_tokens or 0)
    )
    completion = response.usage.output_tokens + message.usage.output_tokens
    counted_since(served, before, (prompt, completion))
    wait_for(
        lambda: served.rows("usage") == (3, prompt, completion),
        timeout=30,
        interval=1,
        what=f"the key's usage rows: 3 requests, {prompt} and {completion} tokens",
    )

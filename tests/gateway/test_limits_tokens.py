"""Tokens counted whatever the client does: a stream cut short is charged its prompt, each of n
answers is charged, and requests at once take a token budget over by one reservation at most.

A gateway process as the run command starts it (two workers) in front of the real llama.cpp
server on a tiny model, on a database of its own; what was charged is read from the gateway's
/metrics (llmgw_gateway_tokens_total) and from the rows the usage figures and their CSV are
made of (KeyUsageDay).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from llmgw.engine import DEFAULT_CONTEXT_LENGTH, find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.engine import running_engine
from tests.support.gateway_processes import serve_chat_with_keys
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]

PROMPT = "hello there, how are you today? tell me all about the weather where you live"
BUDGET = 100  # tokens per day of the key "budget"
KEYS = {"probe": {}, "cut": {}, "choices": {}, "budget": {"tokens_per_day": BUDGET}}


@dataclass
class Served:
    system: System
    secrets: dict[str, str]

    def post(self, path: str, key: str, body: Any, **kwargs: Any) -> requests.Response:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {
            "Authorization": f"Bearer {self.secrets[key]}",
            "Content-Type": "application/json",
        }
        return requests.post(
            f"{self.system.url}{path}", data=raw, headers=headers, timeout=60, **kwargs
        )

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens the gateway counted for chat, all workers together."""
        scraped = requests.get(f"{self.system.url}/metrics", timeout=10).text
        found = {"prompt": 0, "completion": 0}
        for labels, value in re.findall(
            r"^llmgw_gateway_tokens_total\{(.*)\} (\S+)$", scraped, re.MULTILINE
        ):
            named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if named.get("model") == "chat":
                found[named["kind"]] += int(float(value))
        return found["prompt"], found["completion"]

    def rows(self, key: str) -> tuple[int, int]:
        """(prompt, completion) tokens in the key's usage rows (what its CSV adds up)."""
        script = (
            "from django.db.models import Sum\n"
            "from access.models import GatewayKey, KeyUsageDay\n"
            f"key = GatewayKey.objects.get(name={key!r})\n"
            "sums = KeyUsageDay.objects.filter(key=key).aggregate("
            "p=Sum('prompt_tokens'), c=Sum('completion_tokens'))\n"
            "print('ROWS', sums['p'] or 0, sums['c'] or 0)\n"
        )
        printed = self.system.manage("shell", "-c", script).splitlines()
        _, prompt, completion = next(line for line in printed if line.startswith("ROWS")).split()
        return int(prompt), int(completion)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("tokens")
    write_tiny_model(folder / "tiny.gguf", seed=1, context_length=8192)
    system = System(folder / "system")
    # Each machine counting alone: what is measured here is one machine's counts.
    system.env["LLMGW_LIMITS_REDIS"] = "off"
    try:
        with running_engine(
            folder / "tiny.gguf",
            alias="chat",
            context_length=DEFAULT_CONTEXT_LENGTH,
            slots=2,
            log=folder / "engine.log",
        ) as engine:
            secrets = serve_chat_with_keys(system, int(engine.rsplit(":", 1)[1]), KEYS)
            yield Served(system, secrets)
    finally:
        system.close()


def prompt_tokens(served: Served, path: str, body: dict[str, Any]) -> int:
    """The prompt's tokens as the engine counts them (its usage, for a whole answer)."""
    answer = served.post(path, "probe", {**body, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens"])


def counted_since(served: Served, before: tuple[int, int], prompt: int) -> tuple[int, int]:
    """What the gateway counted since `before`, once its prompt figure reaches `prompt` (a
    stream is counted when it ends: just after the client leaves)."""
    wait_for(
        lambda: served.tokens()[0] - before[0] >= prompt,
        timeout=20,
        what=f"{prompt} prompt tokens counted (from {before})",
    )
    now = served.tokens()
    return now[0] - before[0], now[1] - before[1]


def test_a_stream_cut_short_is_charged_its_prompt_and_what_it_was_sent(served: Served) -> None:
    body = {"model": "chat", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
    prompt = prompt_tokens(served, "/v1/completions", body)
    assert prompt > 10
    before = served.tokens()
    received = []
    for _ in range(5):
        with served.post("/v1/completions", "cut", {**body, "stream": True}, stream=True) as cut:
            assert cut.status_code == 200
            events = []
            for line in cut.iter_lines():
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 3:
                    break  # the client leaves: the connection closes with the block
            received.append(events)
    # The gateway's own question to the engine (the prompt's progress) is not in the stream.
    assert all("prompt_progress" not in event for events in received for event in events)
    assert all(event["choices"][0]["finish_reason"] is None for e in received for event in e)
    counted = counted_since(served, before, 5 * prompt)
    assert counted[0] == 5 * prompt
    # What was sent: the events the client read, and those already on their way to it when it
    # left (its socket's buffers hold a few hundred); far from the 1,500 each would have had.
    assert 5 * 3 <= counted[1] < 5 * 1500 / 2, counted
    # The usage figures (and their CSV) count the same.
    wait_for(
        lambda: served.rows("cut") == counted,
        timeout=30,
        interval=1,
        what="the key's usage rows written",
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ],
    ids=["completions", "chat"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_each_of_n_answers_is_charged(
    served: Served, path: str, body: dict[str, Any], stream: bool
) -> None:
    body = {"model": "chat", **body, "ignore_eos": True}
    prompt = prompt_tokens(served, path, body)
    before = served.tokens()
    asked = {**body, "n": 2, "max_tokens": 8, "stream": stream}
    answer = served.post(path, "choices", asked)
    assert answer.status_code == 200, answer.text
    if stream:
        indexes = {
            choice["index"]
            for line in answer.content.splitlines()
            if line.startswith(b"data: {")
            for choice in json.loads(line[6:]).get("choices", [])
        }
    else:
        indexes = {choice["index"] for choice in answer.json()["choices"]}
    assert indexes == {0, 1}
    # Both answers ran to their max_tokens (ignore_eos): 8 tokens each, the prompt once.
    assert counted_since(served, before, prompt) == (prompt, 16)


def test_requests_at_once_pass_a_token_budget_by_one_reservation_at_most(served: Served) -> None:
    """Rounds of 16 requests at once until the budget refuses a whole round: what was charged
    passes the budget by one request's reservation at most (each of the 16 takes about 35
    tokens: all at once, they would pass it 5 times over)."""
    body = {"model": "chat", "prompt": "hi", "max_tokens": 32, "ignore_eos": True}
    raw = json.dumps(body).encode()
    # What it may use (gateway.limits.reservation): a token a byte of its body, the template's
    # allowance, its max_tokens.
    reservation = len(raw) + 64 + 32
    before = served.tokens()
    answers: list[requests.Response] = []
    with ThreadPoolExecutor(16) as pool:
        for _ in range(20):
            round_ = list(
                pool.map(lambda _: served.post("/v1/completions", "budget", raw), range(16))
            )
            answers += round_
            if all(a.status_code == 429 for a in round_):
                break
    statuses = [a.status_code for a in answers]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[-16:] == [429] * 16  # the budget was reached
    charged = sum(served.tokens()) - sum(before)
    assert BUDGET <= charged <= BUDGET + reservation, (charged, reservation, statuses)
    refusals = [a.json()["error"]["message"] for a in answers if a.status_code == 429]
    spent = "This key's budget of 100 tokens per day (UTC) is spent ("
    held = "This key's budget of 100 tokens per day (UTC) is held by requests in flight ("
    assert refusals[-1].startswith(spent), refusals[-1]
    assert all(m.startswith((spent, held)) for m in refusals), refusals

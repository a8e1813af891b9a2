"""The gateway's /v1/ endpoints, one declaration each, and what is derived from them.

As Starlette's `routes=[Route(...)]`, the list is data: the relay's route table
(gateway.relay.routes), the 404 that lists what is served (`served`), the rules a body is
checked by (gateway.validate), the operation named on traces (gateway.tracing), how the
prompt is read for routing by prefix (gateway.prefix) and the tokens from an answer
(gateway.proxy) are all read from ENDPOINTS. An endpoint is added here, with its body's rules in
gateway.validate when they are new, and its tests; tests/gateway/test_endpoints.py holds the
list and the code together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import validate
from .prefix import anthropic_prompt_text, prompt_text, responses_prompt_text
from .proxy import AnthropicTally, ResponsesTally, StreamTally, usage_of


@dataclass(frozen=True)
class Endpoint:
    """One /v1/ endpoint and how the gateway serves it."""

    path: str
    # Its name in /metrics (the endpoint label of llmgw_gateway_requests_total and of the
    # latency histogram) and in the traffic figures.
    name: str
    method: str = "POST"
    # Whose API its requests, answers and refusals follow: OpenAI's ({"error": {...}}), its
    # Responses API's (the same refusals; its own stream events) or Anthropic's ({"type":
    # "error", "error": {...}}: gateway.errors.anthropic_body).
    api: str = "openai"
    # Sent on to a replica of the model its body names; False: the gateway answers it itself,
    # from its state (the model list).
    relayed: bool = True
    # Its body's "stream": true is answered as server-sent events, relayed as they come.
    streams: bool = False
    # What the engine would answer with a 500, refused with a 400 first (gateway.validate).
    rules: validate.Rules | None = None
    # gen_ai.operation.name on its traces, in OpenTelemetry's GenAI words.
    operation: str = ""
    # The text its prompt starts with, for routing by prefix (gateway.prefix); None: the
    # request is sent to the least loaded replica whatever its model's routing.
    prompt: Callable[[dict[str, Any]], str] | None = None
    # (prompt, completion) tokens read from a whole answer.
    usage: Callable[[bytes], tuple[int, int]] = usage_of
    # What counts a streamed answer's tokens as its events pass.
    tally: type[StreamTally] = StreamTally
    # The engine is asked to report a stream's prompt as it reads it (proxy.with_progress): the
    # prompt's tokens are known, and charged, however soon the stream ends. Not the Messages
    # API: the default engine sends it no reports (its message_start, with the first token, says them).
    progress: bool = False
    # The body's fields that bound the answer's tokens, the first one given counting (a token
    # limit reserves that many while the request is in flight: gateway.limits.reservation); ()
    # for an endpoint that generates nothing (embeddings, a count of tokens, a ranking): its
    # prompt is all it reserves.
    answer_limit: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    # Its requests use tokens (a prompt read, an answer made): a token limit reserves them while
    # it is in flight. False: it is counted by rpm alone (a count of a prompt's tokens).
    uses_tokens: bool = True
    # A feature the engine must be started with to serve it (the engine's flag of that name,
    # --embeddings); None: every engine serves it.
    needs: str | None = None


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/v1/models", "models", method="GET", relayed=False),
    Endpoint(
        "/v1/chat/completions",
        "chat",
        streams=True,
        rules=validate.chat,
        operation="chat",
        prompt=prompt_text,
        progress=True,
    ),
    Endpoint(
        "/v1/completions",
        "completions",
        streams=True,
        rules=validate.completions,
        operation="text_completion",
        prompt=prompt_text,
        progress=True,
    ),
    Endpoint(
        "/v1/embeddings",
        "embeddings",
        rules=validate.embeddings,
        operation="embeddings",
        prompt=prompt_text,
        needs="embeddings",
        answer_limit=(),
    ),
    Endpoint(
        "/v1/responses",
        "responses",
        api="responses",
        streams=True,
        rules=validate.responses,
        operation="chat",
        prompt=responses_prompt_text,
        tally=ResponsesTally,
        progress=True,
        answer_limit=("max_output_tokens",),
    ),
    Endpoint(
        "/v1/messages",
        "messages",
        api="anthropic",
        streams=True,
        rules=validate.messages,
        operation="chat",
        prompt=anthropic_prompt_text,
        tally=AnthropicTally,
        answer_limit=("max_tokens",),
    ),
    # A reranker's (a model defined with reranking: true): the Cohere/Jina shape the engine
    # speaks; not a generation.
    Endpoint(
        "/v1/rerank",
        "rerank",
        rules=validate.rerank,
        operation="rerank",
        needs="reranking",
        answer_limit=(),
    ),
    # Not a generation: the engine's tokenizer and the chat template, counted by rpm only.
    Endpoint(
        "/v1/messages/count_tokens",
        "count_tokens",
        api="anthropic",
        rules=validate.count_tokens,
        operation="count_tokens",
        answer_limit=(),
        uses_tokens=False,
    ),
)


def served(endpoints: Sequence[Endpoint] = ENDPOINTS) -> str:
    """The endpoints as a sentence's end, each method named once where it starts: "GET
    /v1/models, POST /v1/chat/completions, /v1/completions and /v1/embeddings"."""
    named: list[str] = []
    method = ""
    for endpoint in endpoints:
        same = endpoint.method == method
        named.append(endpoint.path if same else f"{endpoint.method} {endpoint.path}")
        method = endpoint.method
    if len(named) < 2:
        return "".join(named)
    return f"{', '.join(named[:-1])} and {named[-1]}"

"""The gateway's check of /v1/ bodies (gateway.validate): what llama-server would answer with a
500 is a 400 from the gateway that names the field and says what to send.

ENGINE_500 lists the bodies llama-server (llama-cpp-python 0.3.36's llama.cpp, the tiny test
model) answered with a 500 when sent to it straight, measured 2026-12-03; the last test sends
them again to a real engine (still 500) and through the gateway (400, and the engine never sees
them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from gateway import validate
from gateway.asgi import parse_body
from gateway.endpoints import ENDPOINTS
from gateway.errors import Refusal
from llmgw.engine import find_engine
from tests.support.waiting import wait_for

HI = [{"role": "user", "content": "hi"}]


# The body rules of each endpoint, by its name (gateway.endpoints): what the cases below name.
RULES = {endpoint.name: endpoint.rules for endpoint in ENDPOINTS if endpoint.rules is not None}


def refusal(endpoint: str, body: dict[str, Any]) -> Refusal | None:
    return validate.refusal(RULES.get(endpoint), body)  # none (the model list): the walk alone


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "messages": HI, "max_tokens": 4, **fields}


def messages(*items: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "messages": list(items), "max_tokens": 4}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "prompt": "hi", "max_tokens": 4, **fields}


def embedding(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", **fields}


def response(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "input": "hi", **fields}


def anthropic(*items: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "max_tokens": 4, "messages": list(items) or HI, **fields}


def raw(text: str) -> dict[str, Any]:
    """A body as the gateway parses it (1e400 and lone surrogates come only from JSON text)."""
    body = parse_body(text.encode())
    assert isinstance(body, dict), body
    return body


M = '"model": "tiny-chat"'
MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'
TOOL_ASKED = {"role": "user", "content": "x"}

# (endpoint, what, body, the param the refusal names): each was a 500 from the engine.
ENGINE_500: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat", "max_tokens 1e400", raw(f'{{{M}, {MESSAGES}, "max_tokens": 1e400}}'), "max_tokens"),
    ("chat", "max_completion_tokens 1e400", chat(max_completion_tokens=math.inf), "max_completion_tokens"),
    ("chat", "temperature 1e400", chat(temperature=math.inf), "temperature"),
    ("chat", "temperature -1e400", chat(temperature=-math.inf), "temperature"),
    ("chat", "top_p 1e400", chat(top_p=math.inf), "top_p"),
    ("chat", "n 1e400", chat(n=math.inf), "n"),
    ("chat", "presence_penalty 1e400", chat(presence_penalty=math.inf), "presence_penalty"),
    ("chat", "frequency_penalty 1e400", chat(frequency_penalty=math.inf), "frequency_penalty"),
    ("chat", "seed 1e400", chat(seed=math.inf), "seed"),
    ("chat", "top_logprobs 1e400", chat(logprobs=True, top_logprobs=math.inf), "top_logprobs"),
    ("chat", "logit_bias 1e400", chat(logit_bias={"5": math.inf}), "logit_bias['5']"),
    # The engine's own fields: their numbers are walked too.
    ("chat", "top_k 1e400", chat(top_k=math.inf), "top_k"),
    ("chat", "n_predict 1e400", chat(n_predict=math.inf), "n_predict"),
    ("chat", "n_probs 1e400", chat(n_probs=math.inf), "n_probs"),
    ("chat", "id_slot 1e400", chat(id_slot=math.inf), "id_slot"),
    ("chat", "n_keep 1e400", chat(n_keep=math.inf), "n_keep"),
    ("chat", "dry_multiplier 1e400", chat(dry_multiplier=math.inf), "dry_multiplier"),
    ("chat", "1e400 in an unknown field", chat(xyz=math.inf), "xyz"),
    ("chat", "a lone surrogate in stop", raw(f'{{{M}, {MESSAGES}, "stop": "\\ud800"}}'), "stop"),
    ("chat", "a lone surrogate in content", messages({"role": "user", "content": "\ud800"}), "messages[0].content"),
    ("chat", "a lone low surrogate", messages({"role": "user", "content": "a\udc00b"}), "messages[0].content"),
    ("chat", "a lone surrogate in role", messages({"role": "\ud800", "content": "x"}), "messages[0].role"),
    ("chat", "a lone surrogate in an unknown field", chat(xyz="\ud800"), "xyz"),
    ("chat", "a lone surrogate in a key", chat(**{"\ud800": 1}), "'\\ud800'"),
    ("chat", "a lone surrogate in the model", chat(model="\ud800"), "model"),
    ("chat", "role a number", messages({"role": 5, "content": "x"}), "messages[0].role"),
    ("chat", "role null", messages({"role": None, "content": "x"}), "messages[0].role"),
    ("chat", "no role", messages({"content": "x"}), "messages[0].role"),
    ("chat", "an image part", messages({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}), "messages[0].content[0].type"),
    ("chat", "an audio part", messages({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}), "messages[0].content[0].type"),
    ("chat", "a video part", messages({"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}), "messages[0].content[0].type"),
    ("chat", "a text part whose text is a number", messages({"role": "user", "content": [{"type": "text", "text": 5}]}), "messages[0].content[0].text"),
    ("chat", "a text part without text", messages({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text"),
    ("chat", "name a number", messages({"role": "user", "content": "x", "name": 5}), "messages[0].name"),
    ("chat", "name null", messages({"role": "user", "content": "x", "name": None}), "messages[0].name"),
    ("chat", "tool_call_id a number", messages(TOOL_ASKED, {"role": "tool", "tool_call_id": 5, "content": "y"}), "messages[1].tool_call_id"),
    ("chat", "reasoning_content a number", messages(TOOL_ASKED, {"role": "assistant", "content": "y", "reasoning_content": 5}, TOOL_ASKED), "messages[1].reasoning_content"),
    ("chat", "tool_calls a string", messages(TOOL_ASKED, {"role": "assistant", "content": "y", "tool_calls": "x"}), "messages[1].tool_calls"),
    ("chat", "tool_calls an object", messages(TOOL_ASKED, {"role": "assistant", "tool_calls": {"a": 1}}, TOOL_ASKED), "messages[1].tool_calls"),
    ("chat", "a tool call that is a string", messages(TOOL_ASKED, {"role": "assistant", "tool_calls": ["x"]}, TOOL_ASKED), "messages[1].tool_calls[0].type"),
    ("chat", "a tool call without arguments", messages(TOOL_ASKED, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}, TOOL_ASKED), "messages[1].tool_calls[0].function.arguments"),
    ("chat", "a tool call id a number", messages(TOOL_ASKED, {"role": "assistant", "tool_calls": [{"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, TOOL_ASKED), "messages[1].tool_calls[0].id"),
    ("chat", "tools a string", chat(tools="x"), "tools"),
    ("chat", "a tool that is a number", chat(tools=[5]), "tools[0].type"),
    ("chat", "a tool of another type", chat(tools=[{"type": "code"}]), "tools[0].type"),
    ("chat", "a tool without function", chat(tools=[{"type": "function"}]), "tools[0].function"),
    ("chat", "a tool without a name", chat(tools=[{"type": "function", "function": {}}]), "tools[0].function"),
    ("chat", "a tool named by a number", chat(tools=[{"type": "function", "function": {"name": 5}}]), "tools[0].function"),
    ("chat", "a tool description a number", chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]), "tools[0].function.description"),
    ("chat", "reasoning_format a number", chat(reasoning_format=5), "reasoning_format"),
    ("chat", "reasoning_format unknown", chat(reasoning_format="bogus"), "reasoning_format"),
    ("chat", "json_schema and grammar", chat(json_schema={"type": "object"}, grammar='root ::= "a"'), "grammar"),
    ("completions", "a lone surrogate in prompt", completion(prompt="\ud800"), "prompt"),
    ("completions", "a lone surrogate in a prompt list", completion(prompt=["\udfff"]), "prompt[0]"),
    ("completions", "max_tokens 1e400", completion(max_tokens=math.inf), "max_tokens"),
    ("completions", "temperature 1e400", completion(temperature=math.inf), "temperature"),
    ("completions", "logprobs 1e400", completion(logprobs=math.inf), "logprobs"),
    ("completions", "best_of 1e400", completion(best_of=math.inf), "best_of"),
    ("completions", "seed 1e400", completion(seed=math.inf), "seed"),
    ("completions", "n 1e400", completion(n=math.inf), "n"),
    ("embeddings", "input a number", embedding(input=5), "input"),
    ("embeddings", "input null", embedding(input=None), "input"),
    ("embeddings", "input an object", embedding(input={"a": 1}), "input"),
    ("embeddings", "input nested three deep", embedding(input=[[[1, 2]]]), "input[0][0]"),
    ("embeddings", "input lists of strings", embedding(input=[["a"]]), "input[0][0]"),
    ("embeddings", "input a list of floats", embedding(input=[1.5]), "input[0]"),
    ("embeddings", "a lone surrogate in input", embedding(input="\ud800"), "input"),
    ("embeddings", "encoding_format a number", embedding(input="hi", encoding_format=5), "encoding_format"),
    ("embeddings", "dimensions 1e400", embedding(input="hi", dimensions=math.inf), "dimensions"),
    ("responses", "a text part whose text is a number", response(input=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}]), "input[0].content[0].text"),
    ("responses", "a tool without a name", response(tools=[{"type": "function"}]), "tools[0]"),
    ("messages", "no messages", {"model": "tiny-chat", "max_tokens": 4}, "messages"),
    ("messages", "role a number", anthropic({"role": 5, "content": "x"}), "messages[0].role"),
    ("messages", "a text block without text", anthropic({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0]"),
    ("messages", "a text block whose text is a number", anthropic({"role": "user", "content": [{"type": "text", "text": 5}]}), "messages[0].content[0]"),
    ("messages", "an image block", anthropic({"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}), "messages[0].content[0].type"),
    ("count_tokens", "no messages", {"model": "tiny-chat"}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [pytest.param(e, b, p, id=f"{e}: {what}") for e, what, b, p in ENGINE_500],
)
def test_it_refuses_what_the_engine_answered_with_a_500(
    endpoint: str, body: dict[str, Any], param: str
) -> None:
    refused = refusal(endpoint, body)
    assert refused is not None
    assert refused.status == 400
    error = refused.json()["error"]
    assert isinstance(error, dict)
    assert error["param"] == param
    assert error["code"] == "invalid_request"
    assert error["type"] == "invalid_request_error"
    # The refusal itself is sendable: its JSON is ASCII whatever the body held.
    json.loads(refused.body())


# Bodies the engine takes (or refuses itself with a 400) that still break what OpenAI documents.
OPENAI_RULES: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat", chat(max_tokens=0), "max_tokens", "max_tokens must be a whole number from 1 to 2,147,483,647 (the most tokens the answer may have); got 0. Omit it for the default."),
    ("chat", chat(max_tokens=2.5), "max_tokens", "got 2.5"),
    ("chat", chat(max_tokens=True), "max_tokens", "got true"),
    ("chat", chat(max_tokens="4"), "max_tokens", "got the string '4'"),
    ("chat", chat(temperature=2.5), "temperature", "temperature must be a number from 0 to 2 (higher is more random); got 2.5. Omit it for the default."),
    ("chat", chat(top_p=-3), "top_p", "top_p must be a number from 0 to 1"),
    ("chat", chat(n=0), "n", "n must be a whole number from 1 to 128"),
    ("chat", chat(presence_penalty=5), "presence_penalty", "from -2 to 2"),
    ("chat", chat(seed=2**70), "seed", "seed must be a whole number"),
    ("chat", chat(logprobs=5), "logprobs", "logprobs must be true or false"),
    ("chat", chat(top_logprobs=50), "top_logprobs", "from 0 to 20"),
    ("chat", chat(stop=["a", "b", "c", "d", "e"]), "stop", "stop must be a string or a list of at most 4 strings (where the answer stops); got a list of 5."),
    ("chat", chat(stop=[5]), "stop", "got a list holding 5"),
    ("chat", chat(stream="yes"), "stream", "stream must be true or false"),
    ("chat", chat(stream_options="x"), "stream_options", "stream_options must be an object"),
    ("chat", chat(logit_bias=[1]), "logit_bias[0]", "logit_bias[0] must be a pair [token, bias]"),
    ("chat", chat(logit_bias=[[-1, 5]]), "logit_bias[0]", "must be a pair [token, bias]"),
    ("chat", chat(logit_bias=[[2, 500]]), "logit_bias[0]", "from -100 to 100"),
    ("chat", chat(logit_bias=7), "logit_bias", "logit_bias must be an object mapping token ids"),
    ("chat", chat(logit_bias={"abc": 1}), "logit_bias['abc']", "'abc' is not a token id"),
    ("chat", chat(logit_bias={"5": 101}), "logit_bias['5']", "from -100 to 100"),
    ("chat", chat(user=5), "user", "user must be a string"),
    ("chat", chat(tool_choice=5), "tool_choice", 'tool_choice must be "none", "auto", "required"'),
    ("chat", chat(response_format="json"), "response_format", 'response_format must be {"type": "text"}'),
    ("chat", chat(response_format={"type": "xml"}), "response_format.type", "got type the string 'xml'"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": 5}), "response_format.json_schema", "whose schema is a JSON Schema object"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools[0].function.parameters", "must be a JSON Schema object"),
    ("chat", {"model": "m"}, "messages", 'messages must be a non-empty list of messages, like [{"role": "user", "content": "Hello"}]; got nothing.'),
    ("chat", messages(), "messages", "got an empty list"),
    ("chat", messages(5), "messages[0]", "messages[0] must be an object with a role and content"),
    ("chat", messages({"role": "wizard", "content": "x"}), "messages[0].role", "messages[0].role must be one of system, user, assistant, tool, developer, function; got the string 'wizard'."),
    ("chat", messages({"role": "user"}), "messages[0].content", "messages[0] (user) needs content: a string, or a list of text parts"),
    ("chat", messages({"role": "user", "content": None}), "messages[0].content", "needs content"),
    ("chat", messages(TOOL_ASKED, {"role": "assistant"}), "messages[1].content", "(an assistant message may instead have tool_calls)"),
    ("chat", messages({"role": "user", "content": 5}), "messages[0].content", "must be a string or a list of text parts"),
    ("chat", messages({"role": "user", "content": [{"type": "file", "file": {}}]}), "messages[0].content[0].type", "messages[0].content[0] is a part of type file, and this model takes text only"),
    ("chat", messages({"role": "user", "content": ["hi"]}), "messages[0].content[0]", "got the string 'hi'"),
    ("chat", messages({"role": "user", "content": "x", "tool_calls": []}), "messages[0].tool_calls", "belongs to assistant messages only"),
    ("completions", completion(prompt=None), "prompt", "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"),
    ("completions", {"model": "m"}, "prompt", "got nothing"),
    ("completions", completion(prompt=[]), "prompt", "got an empty list"),
    ("completions", completion(prompt=["a", 1]), "prompt[1]", "prompt is a list of strings, so prompt[1] must be one too; got 1."),
    ("completions", completion(prompt=[1, -1]), "prompt[1]", "prompt[1] must be a token id (a whole number from 0); got -1. prompt is read as token ids because its first item is one"),
    ("completions", completion(prompt=[[1], []]), "prompt[1]", "must be a non-empty list of token ids"),
    ("completions", completion(logprobs=50), "logprobs", "logprobs must be a whole number from 0 to 5"),
    ("completions", completion(echo="x"), "echo", "echo must be true or false"),
    ("completions", completion(suffix=5), "suffix", "suffix must be a string"),
    ("completions", completion(stop=5), "stop", "stop must be a string or a list"),
    ("embeddings", embedding(), "input", "got nothing"),
    ("embeddings", embedding(input=["a", 1]), "input[1]", "must be one too"),
    ("embeddings", embedding(input="hi", encoding_format="xml"), "encoding_format", "encoding_format must be one of 'float', 'base64'"),
    ("embeddings", embedding(input="hi", dimensions="x"), "dimensions", "dimensions must be a whole number"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "message"),
    [pytest.param(*case, id=f"{case[0]}: {case[2]}: {case[3][:40]}") for case in OPENAI_RULES],
)
def test_it_refuses_what_openai_documents_as_wrong_and_says_what_to_send(
    endpoint: str, body: dict[str, Any], param: str, message: str
) -> None:
    refused = refusal(endpoint, body)
    assert refused is not None
    error = refused.json()["error"]
    assert isinstance(error, dict)
    assert (error["param"], refused.status) == (param, 400)
    assert message in str(error["message"])


def test_the_messages_of_the_refusals_that_matter_read_in_full() -> None:
    def message(endpoint: str, body: dict[str, Any]) -> str:
        refused = refusal(endpoint, body)
        assert refused is not None
        error = refused.json()["error"]
        assert isinstance(error, dict)
        return str(error["message"])

    assert message("chat", chat(max_tokens=math.inf)) == (
        "max_tokens is a number beyond what the engine can read (it parses as infinity); send an "
        "ordinary finite number."
    )
    assert message("chat", messages({"role": "user", "content": "\ud800"})) == (
        "messages[0].content has a lone UTF-16 surrogate (an escape from \\ud800 to \\udfff "
        "without its pair), which is no character; send valid Unicode text (an escaped character "
        "beyond U+FFFF is a pair: high \\ud800-\\udbff, then low \\udc00-\\udfff)."
    )
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    assert message("chat", messages({"role": "user", "content": [image]})) == (
        "messages[0].content[0] is a part of type image_url, and this model takes text only (its "
        "engine has no image or audio encoder). Send the content as text parts or a string, or "
        "ask for a model that takes images."
    )
    assert message("embeddings", embedding(input=[[[1]]])) == (
        "input[0][0] must be a token id (a whole number from 0); got a list."
    )


VALID: list[tuple[str, dict[str, Any]]] = [
    ("chat", chat()),
    ("chat", chat(max_tokens=None, temperature=None, stop=None)),  # null is the default
    ("chat", chat(max_tokens=4.0, temperature=0, top_p=1, n=2, seed=-1, stop="\n")),
    ("chat", chat(stop=["a", "b", "c", "d"], logprobs=True, top_logprobs=5, stream=True, stream_options={"include_usage": True})),
    ("chat", chat(logit_bias={"50256": -100}, user="u1", presence_penalty=-2, frequency_penalty=2)),
    # llama-server's own forms, which its clients send: [token, bias] pairs, false for never.
    ("completions", {"model": "m", "prompt": "a", "logit_bias": [[2, False], ["hello", -5.5]]}),
    ("chat", chat(logit_bias={"2": False})),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}})),
    ("chat", chat(response_format={"type": "json_object"}, reasoning_format="none")),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}], tool_choice="required")),
    ("chat", chat(tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False)),
    # A pair in JSON is one character (U+1F600) once parsed.
    ("chat", raw(f'{{{M}, "messages": [{{"role": "user", "content": "\\ud83d\\ude00 \u00e9"}}]}}')),
    ("chat", messages({"role": "developer", "content": "be brief"}, {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]})),
    ("chat", messages(TOOL_ASKED, {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "a", "content": "y"})),
    ("chat", messages({"role": "user", "content": "x", "name": "bob"}, {"role": "assistant", "content": "y", "reasoning_content": "z"}, {"role": "user", "content": []})),
    ("chat", chat(top_k=40, min_p=0.1, cache_prompt=False, xyz={"anything": [1, "two", None]})),  # the engine's own
    ("completions", completion()),
    ("completions", completion(prompt="")),
    ("completions", completion(prompt=["a", "b"], echo=True, logprobs=5, suffix=None, best_of=1)),
    ("completions", completion(prompt=[1, 2, 3])),
    ("completions", completion(prompt=[[1, 2], [3]])),
    ("embeddings", embedding(input="hi")),
    ("embeddings", embedding(input=["a", ""], encoding_format="base64", dimensions=64, user="u")),
    ("embeddings", embedding(input=[1, 2])),
    ("embeddings", embedding(input=[[1, 2], [3]])),
    ("models", {"anything": 1}),  # endpoints without a table: only the walk
    ("responses", response()),
    ("responses", response(instructions="be brief", max_output_tokens=8, temperature=0.5, store=False, stream=True, previous_response_id=None)),
    ("responses", response(input=[{"role": "developer", "content": "d"}, {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}, {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]}])),
    ("responses", response(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c", "output": "sunny"}])),
    ("responses", response(tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}], tool_choice="auto")),
    ("messages", anthropic()),
    ("messages", anthropic({"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]})),
    ("messages", anthropic(system="be brief", temperature=1, top_k=5, stop_sequences=["x"], stream=True, metadata={"user_id": "u"})),
    ("messages", anthropic(system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}], tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}], tool_choice={"type": "auto"})),
    ("count_tokens", {"model": "m", "messages": HI}),
    # What Codex and Claude Code send: a hosted tool without a name; a system turn among messages.
    ("responses", response(tools=[{"type": "function", "name": "f"}, {"type": "web_search", "external_web_access": False}])),
    ("messages", anthropic({"role": "user", "content": "hi"}, {"role": "system", "content": "notes"})),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body"), VALID)
def test_it_lets_ordinary_requests_through(endpoint: str, body: dict[str, Any]) -> None:
    assert refusal(endpoint, body) is None


def test_the_walk_finds_a_problem_deep_in_the_body_and_names_the_path() -> None:
    deep: Any = "\ud800"
    for _ in range(30):
        deep = {"a": [deep]}
    refused = refusal("chat", chat(extra=deep))
    assert refused is not None
    error = refused.json()["error"]
    assert isinstance(error, dict)
    assert error["param"] == "extra" + ".a[0]" * 30


def test_the_first_problem_in_the_body_is_the_one_named() -> None:
    body = messages(
        {"role": "user", "content": "fine"},
        {"role": "user", "content": "\ud800"},
        {"role": "user", "content": "\udc00"},
    )
    refused = refusal("chat", body)
    assert refused is not None
    error = refused.json()["error"]
    assert isinstance(error, dict)
    assert error["param"] == "messages[1].content"


def test_a_long_key_is_shortened_in_the_refusal() -> None:
    refused = refusal("chat", chat(logit_bias={"x" * 10_000: 1}))
    assert refused is not None
    assert len(refused.body()) < 1000


# A long conversation, for its check's time too (bench/validate.py).
A_THOUSAND_MESSAGES = {
    "model": "tiny-chat",
    "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} of many"}
        for i in range(1000)
    ],
    "max_tokens": 16,
    "temperature": 0.7,
}


def test_a_body_of_a_thousand_messages_passes_the_check() -> None:
    """How long the check takes is bench/validate.py's (a timing here would measure the
    neighbours of a test process as much as the check)."""
    assert refusal("chat", A_THOUSAND_MESSAGES) is None


# -- through a real gateway to a real engine ---------------------------------------------------

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
}


def as_sent(body: dict[str, Any]) -> bytes:
    """The body as a client writes it: infinities as 1e400 (which JSON parsers read as
    infinity), lone surrogates as \\udXXX escapes."""
    return json.dumps(body).replace("-Infinity", "-1e400").replace("Infinity", "1e400").encode()


@pytest.fixture
def engine_url(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    from llmgw.tinygguf import write_tiny_model
    from tests.support.engine import running_engine

    write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    log = tmp_path / "engine.log"
    with running_engine(tmp_path / "tiny.gguf", alias="tiny-chat", log=log) as url:
        yield url, log


@pytest.mark.engine
@pytest.mark.skipif(
    find_engine() is None, reason="llama-server is not built (make setup builds it)"
)
def test_through_the_gateway_each_body_the_engine_failed_on_is_a_400_that_never_reaches_it(
    gw: Any, catalog: Any, engine_url: tuple[str, Path]
) -> None:
    url, log = engine_url
    catalog.add("tiny-chat")
    catalog.replica("tiny-chat", int(url.rsplit(":", 1)[1]))
    headers = {"Content-Type": "application/json"}
    for endpoint, what, body, param in ENGINE_500:
        sent = as_sent(body)
        # Today's engine still fails on it: the table above is the truth, not a memory.
        straight = requests.post(url + PATHS[endpoint], data=sent, headers=headers, timeout=30)
        assert straight.status_code == 500, (what, straight.status_code, straight.text[:200])

        answer = gw.post(PATHS[endpoint], sent)
        assert answer.status_code == 400, (what, answer.text[:300])
        error = answer.json()["error"]
        if endpoint in ("messages", "count_tokens"):  # Anthropic's shape: the message names it
            assert error["type"] == "invalid_request_error", what
            assert param.startswith(error["message"].split(" ", 1)[0]), (what, error)
        else:
            assert (error["code"], error["param"]) == ("invalid_request", param), what
        assert "x-llmgw-revision" not in answer.headers, what  # no replica answered
    # And an ordinary request still goes through to the engine.
    fine = gw.post(PATHS["chat"], chat())
    assert fine.status_code == 200, fine.text[:300]
    assert fine.headers["x-llmgw-model"] == "tiny-chat"

    # The engine logs each request it fails on (a moment later): one line for each body sent
    # to it straight, none for those sent through the gateway.
    def failures() -> int:
        return log.read_text(errors="replace").count("got exception")

    wait_for(
        lambda: failures() >= len(ENGINE_500),
        timeout=5,
        what=f"the engine's log to say it failed on the {len(ENGINE_500)} bodies sent to it",
    )
    assert failures() == len(ENGINE_500)


# What the gateway reads as a body, and whether its values may be left unwalked
# (validate.plain): every body that is plain must be sound.
PLAIN_OR_NOT = [
    (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.5}', True),
    (b'{"model":"m","n":-3,"text":"e1 E2"}', True),
    (b'{"model":"m","x":"\\ud800"}', False),  # a lone surrogate, escaped
    (b'{"model":"m","x":"\\u00e9"}', False),  # an escape: walked, though sound
    ('{"model":"m","x":"\ud800"}'.encode("utf-8", "surrogatepass"), False),  # one encoded
    (b'{"model":"m","x":1e400}', False),  # a float past the largest
    (b'{"model":"m","x":1E5}', False),
    (b'{"model":"m","x":' + b"9" * 400 + b".5}", False),  # a mantissa past it
    (b'{"model":"m","x":[12,' + b"9" * 300 + b"]}", False),  # its run after another's
    (b'{"model":"m","x":"' + b",".join([b"9" * 299] * 50) + b'"}', True),  # runs just short
    ('{"model":"m","x":"é"}'.encode(), False),  # not ASCII
]


@pytest.mark.parametrize(("raw", "expected"), PLAIN_OR_NOT)
def test_a_plain_body_is_one_whose_values_need_no_walk(raw: bytes, expected: bool) -> None:
    assert validate.plain(raw) is expected
    body = parse_body(raw)
    if expected:
        assert isinstance(body, dict) and validate.refusal(None, body) is None


def test_a_body_that_is_not_plain_is_still_walked_and_refused() -> None:
    for raw in (b'{"model":"m","x":"\\ud800"}', b'{"model":"m","x":1e400}'):
        body = parse_body(raw)
        assert isinstance(body, dict) and not validate.plain(raw)
        assert validate.refusal(None, body) is not None

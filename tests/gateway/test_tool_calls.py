"""Tool definitions reach the engine as the client sent them, and the engine's tool calls reach
the client intact, whole and streamed, in each API: chat completions, the Responses API and the
Messages API, read by the official `openai` and `anthropic` SDKs.

The engine here answers with tool calls in the shapes llama.cpp's server writes them (its
server-task.cpp, llama-cpp-python 0.3.36): a tiny random model cannot make one. llama.cpp builds
the grammar that forces a tool call only when the server logs verbosely (-v), and under it a
random model's arguments are bytes that are no UTF-8, which the server answers with a 500
(measured 2026-12-07; docs/gateway.md says so).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.fake_engine import FakeEngine
from tests.support.gateway_state import current_state

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

ARGUMENTS = {"city": "Paris", "days": [1, 2], "note": "caf\u00e9 \u2615"}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
    "required": ["city"],
}


def sse(data: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def split(text: str) -> list[str]:
    """The arguments as an engine streams them: a few characters at a time."""
    return [text[i : i + 7] for i in range(0, len(text), 7)]


ARGS = json.dumps(ARGUMENTS)
CHAT_WHOLE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "chat",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "type": "function",
                        "id": "call_abc",
                        "function": {"name": "get_weather", "arguments": ARGS},
                    }
                ],
            },
        }
    ],
    "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
}


def chat_stream() -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "chat",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    first = {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    parts = [
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
        for part in split(ARGS)
    ]
    return [
        chunk({"role": "assistant", "content": None}),
        chunk(first),
        *parts,
        chunk({}, "tool_calls"),
        b"data: [DONE]\n\n",
    ]


RESPONSE_WHOLE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "model": "chat",
    "status": "completed",
    "output": [
        {
            "type": "function_call",
            "status": "completed",
            "arguments": ARGS,
            "call_id": "call_abc",
            "name": "get_weather",
            "id": "fc_abc",
        }
    ],
    "usage": {"input_tokens": 40, "output_tokens": 12, "total_tokens": 52},
}


def responses_stream() -> list[bytes]:
    item = {
        "type": "function_call",
        "status": "in_progress",
        "arguments": "",
        "call_id": "call_abc",
        "name": "get_weather",
        "id": "fc_abc",
    }
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "chat"}
    events = [
        ("response.created", {"response": created, "sequence_number": 0}),
        ("response.output_item.added", {"output_index": 0, "item": item, "sequence_number": 1}),
        *(
            (
                "response.function_call_arguments.delta",
                {"item_id": "fc_abc", "output_index": 0, "delta": part, "sequence_number": 2},
            )
            for part in split(ARGS)
        ),
        (
            "response.function_call_arguments.done",
            {"item_id": "fc_abc", "output_index": 0, "arguments": ARGS, "sequence_number": 3},
        ),
        (
            "response.output_item.done",
            {
                "output_index": 0,
                "item": {**item, "status": "completed", "arguments": ARGS},
                "sequence_number": 4,
            },
        ),
        ("response.completed", {"response": RESPONSE_WHOLE, "sequence_number": 5}),
    ]
    return [sse({"type": name, **data}, name) for name, data in events]


MESSAGE_WHOLE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "chat",
    "content": [{"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": ARGUMENTS}],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"cache_read_input_tokens": 0, "input_tokens": 40, "output_tokens": 12},
}


def messages_stream() -> list[bytes]:
    start = {**MESSAGE_WHOLE, "content": [], "stop_reason": None}
    start["usage"] = {"cache_read_input_tokens": 0, "input_tokens": 40, "output_tokens": 0}
    block = {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    events = [
        ("message_start", {"message": start}),
        ("content_block_start", {"index": 0, "content_block": block}),
        *(
            (
                "content_block_delta",
                {"index": 0, "delta": {"type": "input_json_delta", "partial_json": part}},
            )
            for part in split(ARGS)
        ),
        ("content_block_stop", {"index": 0}),
        (
            "message_delta",
            {
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 12},
            },
        ),
        ("message_stop", {}),
    ]
    return [sse({"type": name, **data}, name) for name, data in events]


@pytest.fixture
def served(gw: Any, catalog: Any, engine: FakeEngine) -> FakeEngine:
    catalog.add("chat")
    catalog.replica("chat", engine)
    engine.answers = {
        "/v1/chat/completions": CHAT_WHOLE,
        "/v1/responses": RESPONSE_WHOLE,
        "/v1/messages": MESSAGE_WHOLE,
    }
    engine.streams = {
        "/v1/chat/completions": chat_stream(),
        "/v1/responses": responses_stream(),
        "/v1/messages": messages_stream(),
    }
    current_state().reload()
    return engine


def sent_tools(engine: FakeEngine, path: str) -> list[Any]:
    return [body["tools"] for asked, body in engine.requests if asked == path]


def test_chat_tool_calls_reach_the_client_whole_and_streamed(gw: Any, served: FakeEngine) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.key, max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    asked = {"model": "chat", "messages": [{"role": "user", "content": "weather?"}]}
    whole = client.chat.completions.create(**asked, tools=tools, tool_choice="required")
    [call] = whole.choices[0].message.tool_calls
    assert (call.id, call.function.name) == ("call_abc", "get_weather")
    assert json.loads(call.function.arguments) == ARGUMENTS
    with client.chat.completions.stream(**asked, tools=tools) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert json.loads(streamed.function.arguments) == ARGUMENTS
    assert final.choices[0].finish_reason == "tool_calls"
    assert sent_tools(served, "/v1/chat/completions") == [tools, tools]


def test_response_function_calls_reach_the_client_whole_and_streamed(
    gw: Any, served: FakeEngine
) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.key, max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}]
    whole = client.responses.create(model="chat", input="weather?", tools=tools)
    [call] = whole.output
    assert (call.type, call.name, call.call_id) == ("function_call", "get_weather", "call_abc")
    assert json.loads(call.arguments) == ARGUMENTS
    with client.responses.stream(model="chat", input="weather?", tools=tools) as stream:
        deltas = "".join(
            event.delta
            for event in stream
            if event.type == "response.function_call_arguments.delta"
        )
        final = stream.get_final_response()
    assert json.loads(deltas) == ARGUMENTS
    assert json.loads(final.output[0].arguments) == ARGUMENTS
    # The client's own continuation: the call and its output sent back as input items.
    follow = client.responses.create(
        model="chat",
        input=[
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": "call_abc",
                "name": "get_weather",
                "arguments": ARGS,
            },
            {"type": "function_call_output", "call_id": "call_abc", "output": "sunny"},
        ],
        tools=tools,
    )
    assert follow.output[0].type == "function_call"
    assert sent_tools(served, "/v1/responses") == [tools, tools, tools]


def test_anthropic_tool_use_reaches_the_client_whole_and_streamed(
    gw: Any, served: FakeEngine
) -> None:
    client = anthropic.Anthropic(base_url=gw.url, api_key=gw.key, max_retries=0)
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
    asked = {
        "model": "chat",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": tools,
        "tool_choice": {"type": "any"},
    }
    whole = client.messages.create(**asked)
    [block] = whole.content
    assert (block.type, block.name, block.id, block.input) == (
        "tool_use",
        "get_weather",
        "toolu_abc",
        ARGUMENTS,
    )
    assert whole.stop_reason == "tool_use"
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    [streamed] = final.content
    assert streamed.input == ARGUMENTS  # the SDK put the partial JSON back together
    # The answer to the call, as the client sends it next.
    result = client.messages.create(
        **{
            **asked,
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [block.model_dump()]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_abc", "content": "sunny"}
                    ],
                },
            ],
        }
    )
    assert result.content[0].type == "tool_use"
    assert sent_tools(served, "/v1/messages") == [tools, tools, tools]

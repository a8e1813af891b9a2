"""A fast fake OpenAI-compatible engine for gateway benchmarks: no model, so no engine speed in the
figures, only what a gateway in front of it adds.

    python bench/fake_upstream.py PORT

POST /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages answer at once with a
small answer in each API's shape, or, with "stream": true, with CHUNKS server-sent events of
text (and the API's own events around them, as llama.cpp's server writes them): 50 ms apart for the models "bench-slow"
and "bench-pair", at once for any other (the delay goes by the model's name because every gateway passes that on). GET /_stats says how many streams were open at most since the last GET /_stats?reset.

A raw ASGI application under uvicorn with httptools and uvloop: about the least a Python server
can spend per request, so that the upstream is not the bottleneck of the comparison.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

CHUNKS = 20
SLOW_DELAY = 0.05

_open = 0
_most_open = 0
_pair_served = 0  # requests for "bench-pair", whose two replicas are two of these processes

_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench-tiny",
        "choices": [{"index": 0, "text": "hello there", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19},
    }
).encode()
_CHAT = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench-tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello there"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19},
    }
).encode()


def _event(chat: bool, index: int) -> bytes:
    if chat:
        body: dict[str, Any] = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench-tiny",
            "choices": [{"index": 0, "delta": {"content": f"t{index} "}, "finish_reason": None}],
        }
    else:
        body = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "bench-tiny",
            "choices": [{"index": 0, "text": f"t{index} ", "finish_reason": None}],
        }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


# With every field OpenAI's clients require of a response (LiteLLM's parses it).
_RESPONSE_FIELDS: dict[str, Any] = {
    "created_at": 0,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "metadata": {},
}
_RESPONSE = json.dumps(
    {
        "id": "resp_bench",
        "object": "response",
        **_RESPONSE_FIELDS,
        "model": "bench-tiny",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_bench",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "hello there", "annotations": []}],
            }
        ],
        "usage": {"input_tokens": 3, "output_tokens": 16, "total_tokens": 19},
    },
    separators=(",", ":"),
).encode()
_MESSAGE = json.dumps(
    {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "model": "bench-tiny",
        "content": [{"type": "text", "text": "hello there"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 0, "input_tokens": 3, "output_tokens": 16},
    },
    separators=(",", ":"),
).encode()


def _named(kind: str, data: dict[str, Any]) -> bytes:
    body = json.dumps({"type": kind, **data}, separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n".encode()


def _responses_events() -> list[bytes]:
    item = {"item_id": "msg_bench", "output_index": 0, "content_index": 0, "sequence_number": 0}
    started = {"id": "resp_bench", "object": "response", "model": "bench-tiny", "output": []}
    message = {"id": "msg_bench", "type": "message", "role": "assistant", "content": []}
    return [
        _named(
            "response.created",
            {
                "response": {**started, **_RESPONSE_FIELDS, "status": "in_progress"},
                "sequence_number": 0,
            },
        )
        + _named(
            "response.output_item.added", {"output_index": 0, "item": message, "sequence_number": 0}
        ),
        *(
            _named("response.output_text.delta", {**item, "delta": f"t{i} "})
            for i in range(1, CHUNKS - 1)
        ),
        _named("response.output_text.delta", {**item, "delta": "end"})
        + _named("response.output_text.done", {**item, "text": "..."})
        + _named(
            "response.completed",
            {
                "sequence_number": 0,
                "response": {
                    **started,
                    **_RESPONSE_FIELDS,
                    "status": "completed",
                    "usage": {
                        "input_tokens": 3,
                        "output_tokens": CHUNKS - 1,
                        "total_tokens": CHUNKS + 2,
                    },
                },
            },
        ),
    ]


def _messages_events() -> list[bytes]:
    def delta(text: str) -> bytes:
        return _named(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}
        )

    start = {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "bench-tiny",
        "usage": {"cache_read_input_tokens": 0, "input_tokens": 3, "output_tokens": 0},
    }
    return [
        _named("message_start", {"message": start})
        + _named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        + delta("t0 "),
        *(delta(f"t{i} ") for i in range(1, CHUNKS - 1)),
        delta("end")
        + _named("content_block_stop", {"index": 0})
        + _named(
            "message_delta",
            {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": CHUNKS}},
        )
        + _named("message_stop", {}),
    ]


_EVENTS = {chat: [_event(chat, i) for i in range(CHUNKS)] for chat in (False, True)}
# Per API: its whole answer, its stream's events (CHUNKS of them, each sent alone) and its end.
_APIS = {
    "responses": (_RESPONSE, _responses_events(), b""),
    "messages": (_MESSAGE, _messages_events(), b""),
    "chat": (_CHAT, _EVENTS[True], b"data: [DONE]\n\n"),
    "completions": (_COMPLETION, _EVENTS[False], b"data: [DONE]\n\n"),
}


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global _open, _most_open, _pair_served
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        return
    path = scope["path"]
    if path == "/_stats":
        most, pair = _most_open, _pair_served
        if scope["query_string"] == b"reset":
            _most_open, _pair_served = _open, 0
        stats = {"most_open": most, "open": _open, "pair_served": pair}
        await _whole(send, 200, json.dumps(stats).encode())
        return
    if path in ("/v1/models", "/health"):
        await _whole(send, 200, b'{"object": "list", "data": [{"id": "bench-tiny"}]}')
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    body = json.loads(raw or b"{}")
    api = path.rsplit("/", 1)[-1]
    whole, events, end = _APIS.get(
        "chat" if path.endswith("/chat/completions") else api, _APIS["completions"]
    )
    if not body.get("stream"):
        await _whole(send, 200, whole)
        return
    if body.get("model") == "bench-pair":
        _pair_served += 1
    delay = SLOW_DELAY if body.get("model") in ("bench-slow", "bench-pair") else 0.0
    _open += 1
    _most_open = max(_most_open, _open)
    try:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            if delay:
                await asyncio.sleep(delay)
        await send({"type": "http.response.body", "body": end})
    finally:
        _open -= 1


async def _whole(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        application,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        backlog=4096,
        timeout_keep_alive=75,
    )

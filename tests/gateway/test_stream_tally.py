"""A streamed answer's tokens, counted as its events pass (gateway.proxy.StreamTally), from the
events llama.cpp's server sends (their shapes as it wrote them, trimmed)."""

from __future__ import annotations

import json

from gateway import proxy


def event(data: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def progress(total: int, processed: int) -> bytes:
    return event(
        {
            "choices": [{"text": "", "index": 0, "finish_reason": None}],
            "prompt_progress": {"total": total, "cache": 0, "processed": processed},
        }
    )


def token(text: str, index: int = 0) -> bytes:
    return event({"choices": [{"text": text, "index": index, "finish_reason": None}]})


def last(index: int, tokens: int, prompt: int, *, usage: bool = True) -> bytes:
    data: dict[str, object] = {
        "choices": [{"text": "", "index": index, "finish_reason": "length"}],
        "timings": {"prompt_n": 1, "predicted_n": tokens},
    }
    if usage:
        data["usage"] = {"completion_tokens": tokens, "prompt_tokens": prompt}
    return event(data)


def passed(tally: proxy.StreamTally, chunks: list[bytes]) -> bytes:
    return b"".join(tally.feed(chunk) for chunk in chunks) + tally.end()


def test_a_stream_cut_short_counts_its_prompt_from_the_engines_first_report() -> None:
    tally = proxy.StreamTally(strip=True)
    sent = passed(tally, [progress(429, 200), progress(429, 429), token("a"), token("b")])
    assert tally.totals() == (429, 2)
    # The reports were the gateway's question, not the client's: they are not passed on.
    assert sent == token("a") + token("b")


def test_reports_the_client_asked_for_are_passed_on() -> None:
    tally = proxy.StreamTally(strip=False)
    chunks = [progress(12, 12), token("a"), last(0, 1, 12)]
    assert passed(tally, chunks) == b"".join(chunks)
    assert tally.totals() == (12, 1)


def test_events_split_over_chunks_pass_whole_and_are_counted_once() -> None:
    whole = progress(30, 30) + token("a") + token("b") + last(0, 2, 30) + b"data: [DONE]\n\n"
    tally = proxy.StreamTally(strip=True)
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    sent = b"".join(tally.feed(piece) for piece in pieces)
    assert sent + tally.end() == whole[len(progress(30, 30)) :]
    assert sent.endswith(b"\n\n")  # only whole events went on
    assert tally.totals() == (30, 2)


def test_each_of_n_choices_is_counted() -> None:
    # Completions: each choice ends with its own usage (llama.cpp counts one choice in each).
    tally = proxy.StreamTally(strip=True)
    passed(tally, [progress(12, 12), token("a", 1), token("b", 0), last(1, 2, 12), token("c", 0)])
    passed(tally, [last(0, 2, 12)])
    assert tally.totals() == (12, 4)
    # Chat without include_usage: each choice's last event says how many tokens it had.
    tally = proxy.StreamTally(strip=True)
    chunks = [progress(34, 34), token("a", 0), token("b", 1), last(0, 3, 34, usage=False)]
    passed(tally, [*chunks, last(1, 5, 34, usage=False)])
    assert tally.totals() == (34, 8)
    # Chat with include_usage: a usage event with no choice follows the choice that ended.
    tally = proxy.StreamTally(strip=True)
    usage = event({"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 34}})
    passed(tally, [last(1, 4, 34, usage=False), usage, last(0, 6, 34, usage=False)])
    usage_0 = event({"choices": [], "usage": {"completion_tokens": 6, "prompt_tokens": 34}})
    passed(tally, [usage_0])
    assert tally.totals() == (34, 10)


def test_a_streamed_request_asks_the_engine_for_its_prompts_progress() -> None:
    body = b' {"model": "chat", "stream": true}'
    asked = proxy.with_progress(body)
    assert json.loads(asked) == {"return_progress": True, "model": "chat", "stream": True}


# -- the other APIs' streams --------------------------------------------------------------------


def named(kind: str, data: dict[str, object]) -> bytes:
    """An event as llama.cpp writes the Messages and Responses APIs' streams: named."""
    return f"event: {kind}\n".encode() + event({"type": kind, **data})


def test_whole_answers_are_read_in_each_apis_words() -> None:
    chat = b'{"usage":{"completion_tokens":3,"prompt_tokens":41,"total_tokens":44}}'
    responses = (
        b'{"output":[],"usage":{"input_tokens":31,"output_tokens":8,"total_tokens":39,'
        b'"input_tokens_details":{"cached_tokens":30}}}'
    )
    messages = b'{"usage":{"cache_read_input_tokens":11,"input_tokens":20,"output_tokens":8}}'
    assert proxy.usage_of(chat) == (41, 3)
    assert proxy.usage_of(responses) == (31, 8)  # input_tokens counts the cached ones too
    assert proxy.usage_of(messages) == (31, 8)  # Anthropic's does not: added
    assert proxy.usage_of(b'{"input_tokens":31}') == (0, 0)  # a count, not a generation


def anthropic_stream(*, started: bool) -> list[bytes]:
    start = named(
        "message_start",
        {"message": {"usage": {"cache_read_input_tokens": 30, "input_tokens": 5}}},
    )
    deltas = [
        named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": t}})
        for t in ("a", "b")
    ]
    end = [
        named("content_block_stop", {"index": 0}),
        named(
            "message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 4}}
        ),
        named("message_stop", {}),
    ]
    return ([start] if started else []) + deltas + end


def test_a_messages_stream_is_counted_from_its_start_and_its_last_delta() -> None:
    tally = proxy.AnthropicTally(model="chat")
    out = passed(tally, anthropic_stream(started=True))
    assert out == b"".join(anthropic_stream(started=True))  # passed on as it came
    assert tally.totals() == (35, 4)

    cut = proxy.AnthropicTally(model="chat")
    passed(cut, anthropic_stream(started=True)[:3])
    assert cut.totals() == (35, 2)  # its prompt, and a token a delta


def test_a_messages_stream_without_its_start_is_given_one() -> None:
    """llama.cpp sends message_start with the first token that has text: where the first tokens
    are parts of a character, the stream would start with a later event."""
    tally = proxy.AnthropicTally(model="asked-name")
    out = passed(tally, anthropic_stream(started=False))
    first, rest = out.split(b"\n\n", 1)
    assert first.startswith(b"event: message_start\ndata: ")
    data = json.loads(first.split(b"data: ", 1)[1])
    assert data["type"] == "message_start"
    assert data["message"]["model"] == "asked-name" and data["message"]["role"] == "assistant"
    assert data["message"]["content"] == [] and data["message"]["id"].startswith("msg_")
    assert rest == b"".join(anthropic_stream(started=False))
    # Only once, however the events come in chunks.
    again = proxy.AnthropicTally(model="m")
    chunks = [part for e in anthropic_stream(started=False) for part in (e[:7], e[7:])]
    assert passed(again, chunks).count(b"message_start") == 2  # its event line and its type


def test_a_responses_stream_is_counted_from_its_completed_event() -> None:
    events = [
        named("response.created", {"response": {"id": "resp_1", "status": "in_progress"}}),
        *(named("response.output_text.delta", {"delta": t}) for t in ("x", "y", "z")),
        named(
            "response.completed",
            {"response": {"usage": {"input_tokens": 31, "output_tokens": 3, "total_tokens": 34}}},
        ),
    ]
    tally = proxy.ResponsesTally()
    assert passed(tally, events) == b"".join(events)
    assert tally.totals() == (31, 3)
    cut = proxy.ResponsesTally()
    passed(cut, events[:3])
    assert cut.totals() == (0, 2)  # no word of its prompt before the end: a delta a token

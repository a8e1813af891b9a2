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

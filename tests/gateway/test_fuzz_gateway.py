"""Random and hostile input on the gateway's public port: JSON bodies for /v1/, and raw request
lines and header fields. Whatever comes, the answer is never a 5xx from the gateway itself, each
comes within a bound, and the process's memory stays where it was.

The replica is a fake engine that answers every well-formed request (tests.gateway.fake_engine),
so a 5xx could only come from the gateway. Which bodies the real engine would answer with a
500 is tests/gateway/test_validate.py's concern.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.rawhttp import exchange

# Each example's answer within this (the gateway waits for nothing here: the engine is local).
ANSWER_SECONDS = 5
# What the whole run may add to the process's resident memory (the test's own objects included).
MEMORY_GROWTH_BYTES = 64 * 1024 * 1024

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=50)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | json_value},
    optional={"content": st.text(max_size=100) | json_value, "name": json_value},
)
chat_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["chat", "missing"]) | st.text(max_size=30) | json_value},
    optional={
        "messages": st.lists(message, max_size=4) | json_value,
        "max_tokens": st.integers(-5, 10**20) | json_value,
        "temperature": st.floats() | json_value,
        "stream": st.booleans() | json_value,
        "stop": json_value,
        "n": json_value,
        "lora": json_value,
    },
)
raw_text = (
    st.binary(max_size=300)
    | st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass"))
    | st.sampled_from(
        [
            b"1e400",
            b'{"model": "chat", "max_tokens": 1e400}',
            b'{"model": "chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
            b"[" * 10000,
            b'{"model": "chat"' + b', "a": 1' * 2000 + b"}",
            b'{"model": "chat", "n": 123456789012345678901234567890123456789012345678901234567890}',
        ]
    )
)


@pytest.fixture
def gateway_with_a_model(gw: Any, catalog: Any, engine: Any) -> Any:
    catalog.add("chat")
    catalog.replica("chat", engine)
    gw.get("/v1/models")  # the state read once: the key and the model are known
    return gw


def test_v1_bodies_get_no_5xx(gateway_with_a_model: Any) -> None:
    import requests

    gw = gateway_with_a_model
    headers = {"Authorization": f"Bearer {gw.key}", "Content-Type": "application/json"}
    before = resident_bytes()

    @FUZZ
    @given(
        body=chat_body | raw_text,
        path=st.sampled_from(["chat/completions", "completions", "embeddings"]),
    )
    def check(body: Any, path: str) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        started = time.monotonic()
        response = requests.post(f"{gw.url}/v1/{path}", data=data, headers=headers, timeout=30)
        assert time.monotonic() - started < ANSWER_SECONDS
        assert response.status_code < 500, (data[:300], response.status_code, response.text[:300])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"]
            assert len(response.content) < 4096

    check()
    assert resident_bytes() - before < MEMORY_GROWTH_BYTES


token = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
    min_size=1,
    max_size=20,
)
request_line = st.one_of(
    st.builds(
        lambda method, target, version: b"%s %s %s" % (method, target, version),
        st.sampled_from(
            [b"GET", b"POST", b"OPTIONS", b"HEAD", b"PUT", b"DELETE", b"CONNECT", b"TRACE", b"PRI"]
        )
        | token.map(str.encode),
        st.sampled_from(
            [b"/", b"*", b"/v1/models", b"/metrics", b"/login/", b"http://x/", b"/%00", b"/\xff"]
        )
        | st.binary(max_size=40),
        st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b""])
        | st.binary(max_size=10),
    ),
    st.binary(max_size=100),
)
header_field = st.tuples(
    token.map(str.encode) | st.binary(max_size=30),
    st.binary(max_size=200),
)


def test_raw_request_lines_and_headers_get_no_5xx(
    gateway_server: Any, settings: Any, echo: str
) -> None:
    from gateway import protocol

    settings.LLMGW_GATEWAY_FORWARD_TO = echo
    # A head or body announced longer than what comes is cut off well within ANSWER_SECONDS.
    settings.LLMGW_GATEWAY_HEAD_TIMEOUT = 1
    settings.LLMGW_GATEWAY_BODY_TIMEOUT = 1
    protocol.limits.cache_clear()
    before = resident_bytes()

    @FUZZ
    @given(
        line=request_line, fields=st.lists(header_field, max_size=8), body=st.binary(max_size=100)
    )
    def check(line: bytes, fields: list[tuple[bytes, bytes]], body: bytes) -> None:
        head = line + b"\r\n" + b"".join(name + b": " + value + b"\r\n" for name, value in fields)
        started = time.monotonic()
        status, _ = exchange(gateway_server.url, head + b"\r\n" + body, timeout=ANSWER_SECONDS)
        assert time.monotonic() - started < ANSWER_SECONDS
        # 0: the connection was closed without an answer (a head cut off or never finished).
        assert status < 500, (head[:300], status)

    try:
        check()
    finally:
        protocol.limits.cache_clear()
    assert resident_bytes() - before < MEMORY_GROWTH_BYTES

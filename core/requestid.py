"""One request ID per request, in every process it passes through, and in every log line about it.

The gateway applies the rule (chosen) to the client's X-Request-ID; the web takes the gateway's
word (only from a request carrying the gateway's secret) and applies the same rule to anyone
else's. The ID being served is in `current`, where the log formatter and the gateway's request
to the engine find it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

HEADER = "X-Request-ID"
MAX_LENGTH = 64

current: ContextVar[str | None] = ContextVar("llmgw_request_id", default=None)


def new() -> str:
    return os.urandom(16).hex()


def sane(sent: bytes) -> bool:
    """Whether `sent` may be kept as the request's ID (see the rule above). No regular
    expression: this runs for every request the gateway serves (about 0.3 µs)."""
    return (
        0 < len(sent) <= MAX_LENGTH
        and sent.isascii()
        and sent.replace(b"-", b"").replace(b".", b"").replace(b"_", b"").isalnum()
    )


def chosen(sent: bytes | str) -> str:
    """The client's ID when it is sane (1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'
    with at least one letter or digit), else a new one: 128 random bits in 32 lowercase hex
    digits, the shape of a W3C trace ID, so that a trace can carry it as its own."""
    if isinstance(sent, str):
        sent = sent.encode("latin-1", "replace")
    return sent.decode("ascii") if sane(sent) else new()


def now() -> str:
    """The ID of the request being served, or a new one outside any."""
    return current.get() or new()


def wsgi(
    app: Callable[..., Iterable[bytes]], trusted: Callable[[dict[str, Any]], bool]
) -> Callable[..., Iterable[bytes]]:
    """The web process's part: each request's ID chosen (taken as it comes where
    `trusted(environ)`, the gateway's word), set in `current` while the application runs,
    put back in the environ for Django to see, and sent back on the answer."""

    def wrapped(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        sent = environ.get("HTTP_X_REQUEST_ID", "")
        request_id = sent if sent and trusted(environ) else chosen(sent)
        environ["HTTP_X_REQUEST_ID"] = request_id

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers = [(k, v) for k, v in headers if k.lower() != "x-request-id"]
            headers.append((HEADER, request_id))
            return start_response(status, headers, exc_info)

        token = current.set(request_id)
        try:
            return app(environ, start)
        finally:
            current.reset(token)

    return wrapped

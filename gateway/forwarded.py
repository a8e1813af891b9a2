"""The web process behind the gateway: whose request it is.

The run command puts the gateway (gateway.asgi) in front of the web process, which then
listens on 127.0.0.1 only: every request comes from the gateway, which sets X-Forwarded-For
to its own client's address (replacing any the client sent). The web takes the client's
address from there, so that login throttling, logs and the audit see people, not the gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

LOOPBACK = ("127.0.0.1", "::1")


def client_address_from_gateway(
    app: Callable[..., Iterable[bytes]],
) -> Callable[..., Iterable[bytes]]:
    def wrapped(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        forwarded = environ.get("HTTP_X_FORWARDED_FOR", "")
        if forwarded and environ.get("REMOTE_ADDR") in LOOPBACK:
            environ["REMOTE_ADDR"] = forwarded.rsplit(",", 1)[-1].strip()
        return app(environ, start_response)

    return wrapped

"""The web process behind the gateway: whose request it is.

The run command puts the gateway (gateway.asgi) in front of the web process, which then
listens on 127.0.0.1 only. The gateway drops every header by which a client would say who it
is (X-Forwarded-*, Forwarded, X-Real-IP, names with an underscore such as SCRIPT_NAME) and
sets X-Forwarded-For to the peer it saw. The web takes the client's address from there, so
that login throttling, logs and the audit see people, not the gateway.

Other local accounts can reach 127.0.0.1 too, so the web believes X-Forwarded-For only from a
request that carries the gateway's secret (LLMGW_GATEWAY_SECRET, made by the run command at
each start and passed to both processes in their environment, which only their owner can
read). Without it the address stays the peer's own (127.0.0.1), which makes a local caller one
client for throttling however it names itself.

The same secret makes the web take the gateway's X-Request-ID as it comes (`from_gateway`);
anyone else's is kept only when it is sane (core.requestid).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable
from typing import Any

GATEWAY_SECRET_HEADER = "X-LLMGW-Gateway"
_SECRET_KEY = "HTTP_" + GATEWAY_SECRET_HEADER.upper().replace("-", "_")
# Set in the environ of a request that carried the gateway's secret.
_FROM_GATEWAY = "llmgw.from_gateway"


def gateway_secret() -> str:
    return os.environ.get("LLMGW_GATEWAY_SECRET", "")


def client_address_from_gateway(
    app: Callable[..., Iterable[bytes]],
) -> Callable[..., Iterable[bytes]]:
    secret = gateway_secret().encode()

    def wrapped(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        sent = environ.pop(_SECRET_KEY, "").encode("latin-1")
        forwarded = environ.pop("HTTP_X_FORWARDED_FOR", "")
        if secret and hmac.compare_digest(sent, secret):
            environ[_FROM_GATEWAY] = True
            if forwarded:
                environ["REMOTE_ADDR"] = forwarded.rsplit(",", 1)[-1].strip()
        return app(environ, start_response)

    return wrapped


def from_gateway(environ: dict[str, Any]) -> bool:
    """Whether the request carried the gateway's secret (client_address_from_gateway, which
    wraps the application outside anything that asks, says so)."""
    return bool(environ.get(_FROM_GATEWAY, False))

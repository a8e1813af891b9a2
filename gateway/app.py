"""The gateway's ASGI application: the Gateway object (gateway.process) made in the lifespan, and
the dispatch of a request to the part that answers it: gateway.relay for /v1/, /metrics here,
gateway.webforward for the rest.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from django.db import DatabaseError, connection

from access import selectors
from catalog.config import ConfigError
from core import requestid
from core.diskspace import var_space
from fleet import renewals

from . import conf, errors, http, relay
from .endpoints import served
from .errors import Refusal
from .http import Receive, Scope, Send
from .metrics import (
    EngineFigures,
    control_plane_exposition,
    exposition,
    model_exposition,
    var_space_exposition,
)
from .process import Gateway
from .state import engine_figures
from .webforward import forward

log = logging.getLogger("llmgw.gateway")


class Application:
    """The ASGI application: `gateway` is made by the lifespan, or bare at the first request
    where there is none (uvicorn with --lifespan off, a test)."""

    def __init__(self) -> None:
        self.gateway: Gateway | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            gateway = self.gateway
            if gateway is None:
                gateway = self.gateway = Gateway()
            # The request's ID (core.requestid), which its answer, its log lines, the engine's
            # request and the web's carry: each request is a task of its own, with its own
            # context, but a test's in-process server may share one, hence the reset.
            token = requestid.current.set(requestid.chosen(http.header(scope, b"x-request-id")))
            try:
                path: str = scope["path"]
                if path.startswith("/v1/"):
                    handler = relay.ROUTES.get(path)
                    if handler is None:
                        await http.refuse(send, _no_such_endpoint(path))
                    else:
                        await handler(gateway, scope, receive, send)
                elif path == "/metrics":
                    await _metrics(gateway, scope, send)
                elif path == renewals.REPORT_PATH:
                    nodes, web, budget = gateway.renewals, gateway.web, gateway.forward_budget
                    nodes.note_alive(scope)
                    await nodes.gate.through(
                        scope,
                        send,
                        lambda: forward(
                            web, budget, scope, receive, send, node=nodes.from_a_node(scope)
                        ),
                    )
                elif path == renewals.PATH:
                    nodes, web, budget = gateway.renewals, gateway.web, gateway.forward_budget
                    await nodes.renew(
                        scope,
                        receive,
                        send,
                        lambda replay: forward(
                            web, budget, scope, replay, send, node=nodes.from_a_node(scope)
                        ),
                    )
                else:
                    await forward(gateway.web, gateway.forward_budget, scope, receive, send)
            finally:
                requestid.current.reset(token)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.gateway = await asyncio.to_thread(Gateway.started)
                except ConfigError as exc:
                    # The same message web, worker and beat stop with; no traceback for a bad file.
                    log.error("llmgw gateway: cannot start: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                except Exception as exc:
                    log.exception("gateway: could not start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                gateway = self.gateway
                if gateway is not None:
                    await gateway.close_pools()
                    await asyncio.to_thread(gateway.stop)
                await send({"type": "lifespan.shutdown.complete"})
                return


application = Application()


def _no_such_endpoint(path: str) -> Refusal:
    return errors.openai_error(
        404,
        f"There is no endpoint {path}. The gateway serves {served()}.",
        code="unknown_url",
    )


# -- /metrics -----------------------------------------------------------------------------


def metrics_refusal(authorization: str) -> Refusal | None:
    """None when this scrape may read /metrics (see LLMGW_METRICS_TOKEN, LLMGW_METRICS_OPEN)."""
    token = conf.metrics_token()
    if token is None:
        if conf.metrics_open():
            return None
        return errors.openai_error(
            403,
            "/metrics is closed: set LLMGW_METRICS_TOKEN and have Prometheus send it "
            "(authorization: {credentials: TOKEN}), or set LLMGW_METRICS_OPEN=true to let "
            "anyone who can reach the gateway read it.",
            code="metrics_closed",
            kind="permission_error",
        )
    scheme, _, sent = authorization.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode()):
        return None
    return errors.openai_error(
        401,
        "/metrics needs the scrape token: send 'Authorization: Bearer TOKEN' with the value of "
        "LLMGW_METRICS_TOKEN.",
        code="invalid_metrics_token",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def _metrics(gateway: Gateway, scope: Scope, send: Send) -> None:
    if scope["method"] not in ("GET", "HEAD"):
        await http.refuse(send, errors.wrong_method("/metrics", "GET"))
        return
    refusal = metrics_refusal(http.header(scope, b"authorization"))
    if refusal is not None:
        await http.refuse(send, refusal)
        return
    board = gateway.metrics
    board.queue_flows_entries.set(gateway.queue.size()[1])
    counters = gateway.state.counters
    if counters is not None and counters.remote is not None:
        board.limits_redis_pending_entries.set(counters.remote.pending)
    text, content_type = await asyncio.to_thread(_exposition, gateway)
    await http.whole(send, 200, text, [(b"content-type", content_type.encode())])


def _exposition(gateway: Gateway) -> tuple[bytes, str]:
    # The prefix table is counted here, off the event loop: one pass over it (1 MB).
    gateway.metrics.prefix_entries.set(gateway.balancer.prefixes.size())
    engines, control_plane = _database_figures(gateway)
    text, content_type = exposition(gateway.metrics, engines)
    return (
        text + model_exposition(engines) + control_plane + var_space_exposition(var_space()),
        content_type,
    )


# The engines' figures and the control plane's state are read from the database at most once in
# this many seconds per process, however often /metrics is asked (it may be left open to anyone:
# LLMGW_METRICS_OPEN), and only when it is asked: at 20,000 serving replicas the engines' figures
# are 20,000 rows, which the gateway read every 5 s before whether or not anyone scraped.
CONTROL_PLANE_READ_SECONDS = 5.0


def _database_figures(gateway: Gateway) -> tuple[tuple[EngineFigures, ...], bytes]:
    """What each serving replica's engine last reported, and the control plane's state as
    Prometheus text, from the database, read at most every CONTROL_PLANE_READ_SECONDS (the
    gateway keeps the last read); nothing while it cannot be read (the gateway's own numbers
    say so: llmgw_gateway_database_up)."""
    read = gateway.control_plane_read
    if read is not None and time.monotonic() - read[0] < CONTROL_PLANE_READ_SECONDS:
        return read[1], read[2]
    try:
        engines = engine_figures()
        text = control_plane_exposition(selectors.control_plane_figures())
    except DatabaseError:
        return (), b""
    finally:
        # Closed, not kept: this runs on whichever of the event loop's executor threads, each of
        # which would otherwise hold a connection of its own open for the process's life.
        connection.close()
    gateway.control_plane_read = (time.monotonic(), engines, text)
    return engines, text

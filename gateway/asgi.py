"""The gateway: a lean ASGI application for /v1/ and /metrics, run by uvicorn's workers.

    uvicorn gateway.asgi:application --workers N --loop uvloop --http httptools

Each worker process serves thousands of streams at once on one event loop. A
request reads no database: keys, catalog and replicas are in memory (see
gateway.state), the choice of replica counts every worker's requests in flight
(gateway.load), engines are reached over pooled connections (gateway.proxy), and
a model's requests take turns in the fair queue (gateway.fairqueue).

Why not Django's own async views: Django shares the models, settings and
services with this module, but its request handling (middleware, URL resolving,
request and response objects) costs more CPU per request than everything else the
gateway does together (bench/gateway.py measures both), and its ASGI handler
consumes a streamed file answer whole before sending it, which the mirror's
weight files cannot afford. So the gateway is plain ASGI, and everything else
(console, admin, /api/v1/, /mirror/) stays a WSGI application under gunicorn:
when LLMGW_GATEWAY_FORWARD_TO names it, the gateway passes every other request
there unchanged, so one address serves both (the run command does this).

This module sets Django up and names the application; the gateway's parts are, by job:

- gateway.process: the Gateway object each process makes in its lifespan (state, pools, figures);
- gateway.app: the application, its lifespan, the dispatch of a request, and /metrics;
- gateway.relay: the /v1/ endpoints (key, body, decide, prepare, send, answer);
- gateway.http: ASGI's plumbing (the one response start, body reads, the stream pump);
- gateway.webforward: everything else, passed to the web process.
"""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()

from .app import Application, application, metrics_refusal  # noqa: E402
from .process import Gateway  # noqa: E402
from .relay import parse_body  # noqa: E402
from .webforward import forwarded_headers  # noqa: E402

__all__ = [
    "Application",
    "Gateway",
    "application",
    "forwarded_headers",
    "metrics_refusal",
    "parse_body",
]

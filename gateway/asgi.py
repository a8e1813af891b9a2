"""The gateway: a lean ASGI application for /v1/ and /metrics, run by uvicorn's workers.

    uvicorn gateway.asgi:application --workers N --loop uvloop --http gateway.protocol:GatewayProtocol

This module sets Django up (the gateway shares its models, settings and services, not its
request handling) and names the application. The parts, by job: gateway.process (the Gateway
each process makes), gateway.app (lifespan, dispatch, /metrics), gateway.relay (/v1/),
gateway.http (ASGI's plumbing) and gateway.webforward (everything else, to the web process).
Why plain ASGI: docs/scaling.md#how-the-gateway-runs-and-how-it-scales-out.
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

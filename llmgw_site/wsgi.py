"""WSGI entry point; server.yaml is applied when the web process starts."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from llmgw.tracing import start_tracing

# Before the application: Django's instrumentation adds its middleware to the settings. Each
# gunicorn worker imports this module after the fork, so each starts its own export thread.
start_tracing("llmgw-web", ("django", "celery", "requests", "psycopg", "redis"))

application = get_wsgi_application()

from core import requestid  # noqa: E402
from core.env import env_bool  # noqa: E402
from gateway.forwarded import client_address_from_gateway, from_gateway  # noqa: E402

# Each request's X-Request-ID: the gateway's as it comes, anyone else's when sane, else new.
application = requestid.wsgi(application, trusted=from_gateway)  # type: ignore[assignment]
if env_bool("LLMGW_WEB_BEHIND_GATEWAY", False):
    application = client_address_from_gateway(application)  # type: ignore[assignment]

from llmgw_site.startup import apply_config_on_start  # noqa: E402  (needs Django set up)

# 4 is gunicorn's "the application failed to load": its master then stops instead of
# starting new workers that fail the same way forever. Other servers just see the exit.
APP_LOAD_ERROR = 4
apply_config_on_start("web", exit_code=APP_LOAD_ERROR)

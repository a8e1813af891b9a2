"""What every process does when it starts: apply server.yaml.

Declared models are created, updated and (when gone from the file) removed to match it. Web
(wsgi), worker and beat (celery signals) and the run command call this before anything else.
"""

from __future__ import annotations

import logging
import sys

from django.db import connections

from catalog.config import ConfigError, current_config
from catalog.services import config_apply
from core.refusals import Refused

from .startlock import startup_lock

log = logging.getLogger("llmgw_site.startup")


def apply_config_on_start(process: str, *, exit_code: int = 2) -> None:
    """Read server.yaml and bring the declared models in line; stop the process if it is wrong.

    The process stops with `exit_code` after printing the problem (file, entry, field,
    line) on stderr, never a traceback.
    """
    current_config.cache_clear()
    try:
        config = current_config()
        # Under the start-up lock: the web, worker and beat of several machines start at once,
        # and two that both find a declared model missing would both insert it.
        with startup_lock():
            result = config_apply(config)
    except ConfigError as exc:
        print(f"llmgw {process}: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(exit_code) from None
    except Refused as exc:
        print(f"llmgw {process}: cannot start: {config.path}: {exc.message}", file=sys.stderr)
        raise SystemExit(exit_code) from None
    finally:
        # Celery forks its pool and beat after this runs: a SQLite connection
        # carried across fork fails with "disk I/O error", so none is kept.
        for connection in connections.all(initialized_only=True):
            if not connection.in_atomic_block:
                connection.close()
    if any(result.values()):
        log.info("%s: applied %s: %s", process, config.path, result)

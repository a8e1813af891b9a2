"""gunicorn's logger, writing its access log (and an error log given as a file) through
core.logfiles: every gunicorn worker appends to one file, rotated at LLMGW_LOG_MAX_BYTES.

gunicorn's own FileHandler never rotates, and each worker holds the file open: a rotation by
anyone else would leave the workers writing to the renamed file. Given with
`--logger-class llmgw_site.gunicornlog.Logger` (the run command does).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from gunicorn.glogging import Logger as GunicornLogger

from core.logfiles import SharedRotatingFileHandler


class Logger(GunicornLogger):
    def _set_handler(
        self, log: logging.Logger, output: Any, fmt: logging.Formatter, stream: Any = None
    ) -> None:
        if output is None or output == "-":
            super()._set_handler(log, output, fmt, stream)
            return
        # Read here, in gunicorn's master, which has not loaded Django's apps (nor needs to):
        # the settings module alone, named as llmgw_site.wsgi names it (a unit may not).
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
        from django.conf import settings

        previous = self._get_gunicorn_handler(log)
        if previous:
            log.handlers.remove(previous)
        handler = SharedRotatingFileHandler(
            output, max_bytes=settings.LLMGW_LOG_MAX_BYTES, backups=settings.LLMGW_LOG_BACKUPS
        )
        handler.setFormatter(fmt)
        handler._gunicorn = True  # type: ignore[attr-defined]  # gunicorn's mark for its own
        log.addHandler(handler)

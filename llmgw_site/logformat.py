"""One line per log event, so that a 5xx and its traceback stay together in any log collector.

    2026-12-02 21:00:00,123 ERROR django.request: Internal Server Error: /api/v1/models
      status=500 method=POST path=/api/v1/models traceback="Traceback (most recent call last):\\n..."

(on one line). The traceback is a JSON string: newlines escaped, quotes kept readable.
"""

from __future__ import annotations

import json
import logging


class OneLineFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(self._prepared(record)).replace("\n", "\\n")
        status = getattr(record, "status_code", None)
        if status is not None:
            line += f" status={status}"
        request = getattr(record, "request", None)
        if request is not None and hasattr(request, "method"):
            line += f" method={request.method} path={json.dumps(request.get_full_path())}"
        if record.exc_info:
            line += f" traceback={json.dumps(self.formatException(record.exc_info))}"
        elif record.stack_info:
            line += f" stack={json.dumps(self.formatStack(record.stack_info))}"
        return line

    def _prepared(self, record: logging.LogRecord) -> logging.LogRecord:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        return record

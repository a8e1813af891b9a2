"""One line per log event, so that a 5xx and its traceback stay together in any log collector.

The traceback is a JSON string on the same line, and a line about a request ends with its ID
(core.requestid). LLMGW_LOG_FORMAT=json writes one JSON object a line (JSONFormatter);
LLMGW_LOG_FILE sends every line to that file and leaves on the terminal only what a person
watching should see (ForTheTerminal).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

from core import requestid
from core.diskspace import disk_full, where_full


def request_id_of(record: logging.LogRecord) -> str | None:
    """The ID of the request the record is about: its own `request_id` (extra=), else the one
    being served where it was logged (formatting happens there: stream and file handlers
    format as the record is made)."""
    return getattr(record, "request_id", None) or requestid.current.get()


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
        request_id = request_id_of(record)
        if request_id is not None:
            line += f" request_id={request_id}"
        if record.exc_info:
            line += f" traceback={json.dumps(self.formatException(record.exc_info))}"
        elif record.stack_info:
            line += f" stack={json.dumps(self.formatStack(record.stack_info))}"
        return line

    def _prepared(self, record: logging.LogRecord) -> logging.LogRecord:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        return record


class JSONFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message; request_id when the
    line is about a request; status, method and path for a request's error (as
    OneLineFormatter); exception (the traceback) or stack when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, UTC)
        line: dict[str, Any] = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_of(record)
        if request_id is not None:
            line["request_id"] = request_id
        status = getattr(record, "status_code", None)
        if status is not None:
            line["status"] = status
        request = getattr(record, "request", None)
        if request is not None and hasattr(request, "method"):
            line["method"] = request.method
            line["path"] = request.get_full_path()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


# llmgw's own loggers: their INFO lines tell of state changes (a node lost, a replica ready, a
# rollout's step), which the terminal shows; everyone else's INFO (a request served, a task
# received, a beat tick) goes to the log file only.
OWN_LOGGERS = (
    "llmgw",
    "core",
    "accounts",
    "catalog",
    "fleet",
    "registry",
    "access",
    "gateway",
    "console",
)


class ForTheTerminal(logging.Filter):
    """Lets through warnings and errors, and INFO from llmgw's own loggers (OWN_LOGGERS); their
    DEBUG (LLMGW_LOG_LEVEL=DEBUG) is in the file only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return record.levelno >= logging.INFO and record.name.split(".", 1)[0] in OWN_LOGGERS


class OncePerSource(logging.Filter):
    """Lets through the first record of each client address, as a WARNING without a traceback.

    For django.security.DisallowedHost: Django logs every request with a foreign Host header at
    ERROR with a full traceback, so anyone could fill the log (and hide what matters in it) by
    sending a wrong Host, and scanners do it all day. One line per address says it happened,
    and where from; the traceback says nothing more (the cause is always the header).

    Memory is bounded: the last `capacity` addresses are remembered (a repeat counts as recent),
    per process; an address forgotten to make room is logged once more if it comes back. At
    1024 addresses of at most 45 characters, that is well under a megabyte.
    """

    def __init__(self, capacity: int = 1024) -> None:
        super().__init__()
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()
        # Web workers may run requests on several threads.
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "llmgw_source_noted", False):
            # Passed by another such filter already (logging configured twice in one process
            # adds a second filter to the logger): its word stands.
            return True
        request = getattr(record, "request", None)
        source = str(getattr(request, "META", {}).get("REMOTE_ADDR") or "an unknown address")
        with self._lock:
            if source in self._seen:
                self._seen.move_to_end(source)
                return False
            self._seen[source] = None
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
        record.msg = (
            f"{record.getMessage()} (from {source}; its further requests with a foreign Host "
            "are not logged)"
        )
        record.args = ()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        record.llmgw_source_noted = True
        return True


class FullDiskOnce(logging.Filter):
    """A record about a write that met a full disk, said in one line and at most once every
    `every` seconds per logger and message (per process): what is retried every second or two
    (beat's sends, the gateway's figures, a node's reports answered 507) would otherwise put a
    traceback, or a line, in the log at each try, while the disk is full and the log cannot
    take them anyway. The line names where the disk is full (core.diskspace.where_full) in
    place of the traceback. Other records pass as they are.

    Memory is bounded: at most `capacity` kinds of line are remembered (then forgotten all)."""

    def __init__(self, every: float = 60.0, capacity: int = 256) -> None:
        super().__init__()
        self.every = every
        self.capacity = capacity
        self._said: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        decided = getattr(record, "llmgw_full_disk", None)
        if decided is not None:
            # Seen by this filter on another handler already (the terminal's, the file's).
            return bool(decided)
        full = disk_full(record.exc_info[1]) if record.exc_info else None
        refused = getattr(record, "status_code", None) == 507
        if full is None and not refused:
            return True
        request = getattr(record, "request", None)
        what = str(record.msg) if full is not None else str(getattr(request, "path", ""))
        key = (record.name, what)
        now = time.monotonic()
        with self._lock:
            last = self._said.get(key)
            passes = last is None or now - last >= self.every
            if passes:
                if len(self._said) >= self.capacity:
                    self._said.clear()
                self._said[key] = now
        record.llmgw_full_disk = passes
        if passes and full is not None:
            first = record.getMessage().split("\n", 1)[0]
            record.msg = f"{first} ({where_full(full).text()}; said once a minute while so)"
            record.args = ()
            record.exc_info, record.exc_text = None, None
        return passes

"""The gateway's access log: one line per /v1/ request, written off the event loop.

`record` runs on the event loop at the end of every request (gateway.relay._count): it appends
one tuple to a bounded buffer (MAX_PENDING; past it a line is dropped and counted in
llmgw_gateway_access_log_dropped_total) and returns, well under a microsecond. A writer thread
takes the buffer a few times a second, looks up the names of the keys it has not seen lately
(access.models.GatewayKey: the database is read there, never on the request path), formats
the lines and appends them to the file.

Every gateway process of the machine appends to the same file, a core.logfiles.SharedLogFile:
each batch is written under an flock that a rotation takes too, so a process's lines are never
cut by another's, two processes never rotate over each other, and a file moved away (by another
process, or a logrotate of the operator's) is followed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from django.db import connection

from access.models import GatewayKey
from core.env import EnvError
from core.logfiles import SharedLogFile

from . import conf
from .metrics import Metrics

log = logging.getLogger("llmgw.gateway")

# Lines a process holds for the writer at most (a tuple of ten fields each, about 200 bytes:
# 13 MB at worst); at 4 writes a second, 260,000 requests a second fill it. Past it a line is
# dropped and counted, rather than the event loop waiting for the disk.
MAX_PENDING = 65_536
# How often the writer takes the buffer; sooner when it is a quarter full.
WRITE_SECONDS = 0.25
# Key names remembered by a process, and for how long: a renamed key shows its new name
# within NAMES_FOR_SECONDS. A lookup that fails (the database is away) is tried again after
# NAMES_RETRY_SECONDS; meanwhile those lines name the key's id only.
NAMES_HELD = 10_000
NAMES_FOR_SECONDS = 300.0
NAMES_RETRY_SECONDS = 30.0
# A write that fails (a full disk) is said in the gateway's log at most this often.
COMPLAIN_SECONDS = 60.0

FORMATS = ("text", "json")

# One request, as record() keeps it: (unix time, request ID, key id, model, endpoint, status,
# prompt tokens, completion tokens, seconds queued, seconds in all).
Entry = tuple[float, str, int | None, str | None, str, int, int, int, float, float]

# Names of keys, models and endpoints whose written form the writer remembers.
WORDS_HELD = 4096


def key_names(ids: Collection[int]) -> dict[int, str]:
    """The names of the gateway keys `ids` (a deleted key is not in the answer)."""
    try:
        return dict(GatewayKey.objects.filter(id__in=list(ids)).values_list("id", "name"))
    finally:
        # Closed, not kept: the writer thread would otherwise hold a connection for the
        # process's life, for a look every few minutes.
        connection.close()


def _plain(value: str) -> bool:
    """Whether `value` is one plain word, written as it is (a request ID always is: see
    core.requestid.chosen). No regular expression: the writer asks this for every line."""
    return (
        value.isascii()
        and value.replace("-", "").replace(".", "").replace("_", "").replace(":", "").isalnum()
    )


class Lines:
    """Lines in one form ("text" or "json") from entries, remembering what repeats between
    them: the current second's timestamp, and how key, model and endpoint names are written
    (at most WORDS_HELD of them)."""

    def __init__(self, form: str) -> None:
        if form not in FORMATS:
            raise ValueError(f"no access log format {form!r}: {FORMATS}")
        self.line = self.text if form == "text" else self.json
        self._second = (-1, "")
        self._words: dict[str | None, str] = {}
        self._quoted: dict[str | None, str] = {}

    def __call__(self, entry: Entry, key: str | None) -> str:
        return self.line(entry, key)

    def text(self, entry: Entry, key: str | None) -> str:
        """`2026-12-07T08:30:01.123Z request_id=… key_id=12 key="alice's app" model=chat
        endpoint=chat status=200 prompt_tokens=31 completion_tokens=5 queued_ms=0.0 ms=12.3`"""
        at, request_id, key_id, model, endpoint, status, prompt, completion, queued, seconds = entry
        word = self.word
        return (
            f"{self.timestamp(at)} "
            f"request_id={request_id if _plain(request_id) else json.dumps(request_id)} "
            f"key_id={'-' if key_id is None else key_id} key={word(key)} model={word(model)} "
            f"endpoint={word(endpoint)} status={status} prompt_tokens={prompt} "
            f"completion_tokens={completion} queued_ms={queued * 1000:.1f} "
            f"ms={seconds * 1000:.1f}\n"
        )

    def json(self, entry: Entry, key: str | None) -> str:
        """The same fields as one JSON object; null for none."""
        at, request_id, key_id, model, endpoint, status, prompt, completion, queued, seconds = entry
        quoted = self.quoted
        request = f'"{request_id}"' if _plain(request_id) else json.dumps(request_id)
        return (
            f'{{"time":"{self.timestamp(at)}","request_id":{request},'
            f'"key_id":{"null" if key_id is None else key_id},"key":{quoted(key)},'
            f'"model":{quoted(model)},"endpoint":{quoted(endpoint)},"status":{status},'
            f'"prompt_tokens":{prompt},"completion_tokens":{completion},'
            f'"queued_ms":{round(queued * 1000, 1)!r},"ms":{round(seconds * 1000, 1)!r}}}\n'
        )

    def timestamp(self, at: float) -> str:
        """UTC ISO 8601 to the millisecond: 2026-12-07T08:30:01.123Z."""
        whole = int(at)
        second, text = self._second
        if whole != second:
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
            self._second = (whole, text)
        return f"{text}.{int((at - whole) * 1000):03d}Z"

    def word(self, value: str | None) -> str:
        """A text line's value: bare when it is a plain word, else quoted as a JSON string (so
        a key named `a b"\\n` cannot break a line or forge a field); "-" for none."""
        written = self._words.get(value)
        if written is None:
            if value is None:
                written = "-"
            elif value != "-" and _plain(value):
                written = value
            else:
                written = json.dumps(value)
            self._remember(self._words, value, written)
        return written

    def quoted(self, value: str | None) -> str:
        written = self._quoted.get(value)
        if written is None:
            written = json.dumps(value)
            self._remember(self._quoted, value, written)
        return written

    @staticmethod
    def _remember(words: dict[str | None, str], value: str | None, written: str) -> None:
        if len(words) >= WORDS_HELD:
            words.clear()
        words[value] = written


def text_line(entry: Entry, key: str | None) -> str:
    return Lines("text")(entry, key)


def json_line(entry: Entry, key: str | None) -> str:
    return Lines("json")(entry, key)


class AccessLog:
    """One process's access log: `record` from the event loop, `start` its writer thread,
    `close` at the process's stop (what is buffered is written first)."""

    def __init__(
        self,
        path: Path,
        *,
        form: str = "text",
        max_bytes: int = 100 * 1024 * 1024,
        backups: int = 5,
        names: Callable[[Collection[int]], dict[int, str]] = key_names,
        board: Metrics | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.path = Path(path)
        self.form = form
        self.line = Lines(form)
        self.names = names
        self.board = board
        self.max_pending = max_pending
        # Lines not written: the buffer was full (counted on the event loop), the file could
        # not be written (counted by the writer); and lines written.
        self.dropped_full = 0
        self.dropped_unwritable = 0
        self.written = 0
        self._pending: deque[Entry] = deque()
        self._wake_at = max(1, max_pending // 4)
        self._wake = threading.Event()
        self._writing = threading.Lock()  # one batch at a time: the writer's, or close()'s
        self._thread: threading.Thread | None = None
        self._stopping = False
        # key id -> (name or None for a key not found, when looked up)
        self._known: dict[int, tuple[str | None, float]] = {}
        self._names_failed_at: float | None = None
        self._complained_at: float | None = None
        self.file = SharedLogFile(self.path, max_bytes=max_bytes, backups=backups)
        self._opened = False

    # -- on the event loop ---------------------------------------------------------------------

    def record(
        self,
        *,
        request_id: str,
        key_id: int | None,
        model: str | None,
        endpoint: str,
        status: int,
        prompt: int,
        completion: int,
        queued: float,
        seconds: float,
    ) -> None:
        """One answered request, for the writer (never waits, never raises on a full buffer)."""
        pending = self._pending
        if len(pending) >= self.max_pending:
            self._drop("full", 1)
            return
        pending.append(
            (
                time.time(),
                request_id,
                key_id,
                model,
                endpoint,
                status,
                prompt,
                completion,
                queued,
                seconds,
            )
        )
        if len(pending) == self._wake_at:
            self._wake.set()

    # -- the writer --------------------------------------------------------------------------

    def open(self) -> None:
        """Open (create, owner-only) the file and its lock file: a path the process cannot
        write stops it at start, not at its first request."""
        self.file.open()
        self._opened = True

    def start(self) -> None:
        if not self._opened:
            self.open()
        self._thread = threading.Thread(target=self._run, name="llmgw-access-log", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the writer and write what is left: nothing recorded before this is lost."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.write_pending()
        self.file.close()
        self._opened = False

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(WRITE_SECONDS)
            self._wake.clear()
            try:
                self.write_pending()
            except Exception:
                # The thread must go on: a line it could not format is lost, not all after it.
                log.exception("gateway: the access log's writer failed")

    def write_pending(self) -> int:
        """Write every line recorded so far; how many were written."""
        with self._writing:
            pending = self._pending
            entries = [pending.popleft() for _ in range(len(pending))]
            if not entries:
                return 0
            names = self._names({entry[2] for entry in entries if entry[2] is not None})
            format_line = self.line
            lines = [
                format_line(entry, None if entry[2] is None else names.get(entry[2])).encode()
                for entry in entries
            ]
            try:
                self.file.append_lines(lines)
            except OSError as exc:
                self._drop("unwritable", len(lines))
                self._complain(exc)
                return 0
            self.written += len(lines)
            if self.board is not None:
                self.board.access_log_lines.inc(len(lines))
            return len(lines)

    def _names(self, ids: set[int]) -> dict[int, str]:
        now = time.monotonic()
        known = self._known
        wanted = [
            key_id
            for key_id in ids
            if key_id not in known or now - known[key_id][1] > NAMES_FOR_SECONDS
        ]
        failed_at = self._names_failed_at
        if wanted and (failed_at is None or now - failed_at > NAMES_RETRY_SECONDS):
            try:
                found = self.names(wanted)
            except Exception as exc:
                self._names_failed_at = now
                log.warning(
                    "gateway: the access log cannot look up key names (%s); its lines name the "
                    "keys' ids only until it can",
                    exc,
                )
            else:
                self._names_failed_at = None
                if len(known) + len(wanted) > NAMES_HELD:
                    known.clear()
                for key_id in wanted:
                    known[key_id] = (found.get(key_id), now)
        return {
            key_id: name
            for key_id in ids
            if key_id in known and (name := known[key_id][0]) is not None
        }

    @property
    def max_bytes(self) -> int:
        return self.file.max_bytes

    @property
    def backups(self) -> int:
        return self.file.backups

    @property
    def dropped(self) -> int:
        return self.dropped_full + self.dropped_unwritable

    def _drop(self, reason: str, count: int) -> None:
        if reason == "full":
            self.dropped_full += count
        else:
            self.dropped_unwritable += count
        if self.board is not None:
            self.board.access_log_dropped.labels(reason).inc(count)

    def _complain(self, exc: OSError) -> None:
        now = time.monotonic()
        if self._complained_at is None or now - self._complained_at > COMPLAIN_SECONDS:
            self._complained_at = now
            log.warning("gateway: could not write the access log %s: %s", self.path, exc)


def from_settings(board: Metrics | None = None, **options: Any) -> AccessLog | None:
    """The access log the settings ask for (gateway.conf), opened; None when it is off. A file
    that cannot be written stops the process here."""
    form = conf.access_log_format()
    if form == "off":
        return None
    path = conf.access_log_file()
    access = AccessLog(
        path,
        form=form,
        max_bytes=conf.access_log_max_bytes(),
        backups=conf.access_log_backups(),
        board=board,
        **options,
    )
    try:
        access.open()
    except OSError as exc:
        raise EnvError(
            f"LLMGW_ACCESS_LOG_FILE={str(path)!r} cannot be written ({exc.strerror}: "
            f"{exc.filename}): name a "
            "file the gateway may write, or set LLMGW_ACCESS_LOG=off."
        ) from None
    return access

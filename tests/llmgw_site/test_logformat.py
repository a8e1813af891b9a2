"""Log lines: a foreign Host header is logged once per client address, at WARNING, without a
traceback, and remembering addresses takes bounded memory; a line about a request names its ID;
LLMGW_LOG_FORMAT=json writes JSON lines; with LLMGW_LOG_FILE the terminal keeps only what a
person should see."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from core import requestid
from llmgw_site.logformat import ForTheTerminal, JSONFormatter, OncePerSource, OneLineFormatter
from tests.support.system import ROOT

DISALLOWED_HOST = "django.security.DisallowedHost"


def fresh_address() -> str:
    # The filter lives as long as the test process: each test uses addresses no other has sent.
    return f"2001:db8::{uuid.uuid4().hex[:4]}:{uuid.uuid4().hex[:4]}"


def foreign_host_records(caplog: Any) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == DISALLOWED_HOST]


@pytest.mark.django_db
def test_a_foreign_host_is_logged_once_per_address_as_a_warning(caplog: Any) -> None:
    first, second = fresh_address(), fresh_address()
    with caplog.at_level(logging.INFO):
        answers = [
            Client().get("/login/", HTTP_HOST="evil.example", REMOTE_ADDR=address).status_code
            for address in (first, first, first, second, first)
        ]
    assert answers == [400] * 5
    records = foreign_host_records(caplog)
    assert [(r.levelname, r.exc_info) for r in records] == [("WARNING", None)] * 2
    assert records[0].getMessage() == (
        "Invalid HTTP_HOST header: 'evil.example'. You may need to add 'evil.example' to "
        f"ALLOWED_HOSTS. (from {first}; its further requests with a foreign Host are not logged)"
    )
    assert f"(from {second};" in records[1].getMessage()
    line = OneLineFormatter().format(records[0])
    assert "WARNING django.security.DisallowedHost" in line
    assert "traceback=" not in line and "Traceback" not in line
    assert 'status=400 method=GET path="/login/"' in line


@pytest.mark.django_db
def test_other_hosts_and_errors_are_logged_as_before(caplog: Any) -> None:
    with caplog.at_level(logging.INFO):
        assert Client().get("/login/", REMOTE_ADDR=fresh_address()).status_code == 200
    assert foreign_host_records(caplog) == []


def record_from(address: str) -> logging.LogRecord:
    record = logging.LogRecord(DISALLOWED_HOST, logging.ERROR, __file__, 1, "Invalid", (), None)
    record.request = type("Request", (), {"META": {"REMOTE_ADDR": address}})()
    return record


def test_memory_is_bounded_by_the_capacity() -> None:
    once = OncePerSource(capacity=3)
    passed = [once.filter(record_from(f"10.0.0.{n}")) for n in range(1000)]
    assert all(passed)
    assert len(once._seen) == 3
    # The oldest is forgotten to make room, and logged once more when it comes back.
    assert once.filter(record_from("10.0.0.0")) is True
    assert once.filter(record_from("10.0.0.999")) is False


def test_a_repeating_address_stays_remembered() -> None:
    once = OncePerSource(capacity=2)
    assert once.filter(record_from("10.0.0.1"))
    assert once.filter(record_from("10.0.0.2"))
    assert not once.filter(record_from("10.0.0.1"))  # now the most recent
    assert once.filter(record_from("10.0.0.3"))  # forgets 10.0.0.2, not 10.0.0.1
    assert not once.filter(record_from("10.0.0.1"))
    assert once.filter(record_from("10.0.0.2"))


def test_a_record_without_a_request_is_counted_as_one_unknown_source() -> None:
    once = OncePerSource()
    bare = logging.LogRecord(DISALLOWED_HOST, logging.ERROR, __file__, 1, "Invalid", (), None)
    assert once.filter(bare)
    assert "(from an unknown address;" in bare.getMessage()
    again = logging.LogRecord(DISALLOWED_HOST, logging.ERROR, __file__, 1, "Invalid", (), None)
    assert not once.filter(again)


def test_two_such_filters_note_the_source_once() -> None:
    """Logging configured twice in one process gives the logger a second filter."""
    first, second = OncePerSource(), OncePerSource()
    record = record_from("192.0.2.9")
    assert first.filter(record) and second.filter(record)
    assert record.getMessage().count("(from 192.0.2.9;") == 1


# -- request IDs, JSON lines and the terminal ------------------------------------------------


def record(name: str = "llmgw.fleet", level: int = logging.INFO, **extra: Any) -> logging.LogRecord:
    made = logging.LogRecord(name, level, __file__, 1, "node %s lost", ("a",), None)
    made.__dict__.update(extra)
    return made


def test_a_line_about_a_request_names_its_id() -> None:
    token = requestid.current.set("req-1")
    try:
        line = OneLineFormatter().format(record())
    finally:
        requestid.current.reset(token)
    assert line.endswith(" INFO llmgw.fleet: node a lost request_id=req-1")
    assert "request_id" not in OneLineFormatter().format(record())  # outside any request
    assert OneLineFormatter().format(record(request_id="given")).endswith(" request_id=given")


def test_json_lines_are_one_object_each() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        failed = record(level=logging.ERROR, exc_info=sys.exc_info(), status_code=500)
    token = requestid.current.set("req-2")
    try:
        line = JSONFormatter().format(failed)
    finally:
        requestid.current.reset(token)
    assert "\n" not in line
    parsed = json.loads(line)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", parsed.pop("time"))
    exception = parsed.pop("exception")
    assert exception.startswith("Traceback") and "ValueError: bad\nthing" in exception
    assert parsed == {
        "level": "ERROR",
        "logger": "llmgw.fleet",
        "message": "node a lost",
        "request_id": "req-2",
        "status": 500,
    }
    assert set(json.loads(JSONFormatter().format(record()))) == {
        "time",
        "level",
        "logger",
        "message",
    }


def test_the_terminal_gets_warnings_errors_and_llmgws_own_news() -> None:
    terminal = ForTheTerminal()
    assert terminal.filter(record("llmgw.fleet"))
    assert terminal.filter(record("gateway"))
    assert terminal.filter(record("catalog.models"))
    assert not terminal.filter(record("celery.app.trace"))  # Task ... succeeded
    assert not terminal.filter(record("celery.beat"))  # Sending due task
    assert not terminal.filter(record("llmgwx"))
    assert terminal.filter(record("celery.app.trace", logging.ERROR))
    assert terminal.filter(record("kombu.connection", logging.WARNING))
    assert not terminal.filter(record("llmgw.fleet", logging.DEBUG))


@pytest.mark.parametrize("format_", ["json", "text", "nonsense"])
def test_llmgw_log_format_chooses_the_lines(format_: str, tmp_path: Path) -> None:
    script = (
        "import django, logging; django.setup(); "
        "logging.getLogger('llmgw.x').warning('hello %s', 'there')"
    )
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "LLMGW"))},
        "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "LLMGW_LOG_FORMAT": format_,
        "LLMGW_LOG_FILE": str(tmp_path / "var" / "log" / "x.log"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, cwd=ROOT, capture_output=True, text=True
    )
    if format_ == "nonsense":
        assert result.returncode != 0
        assert "LLMGW_LOG_FORMAT='nonsense' is not a log format: use text" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    [line] = result.stderr.splitlines()
    assert (tmp_path / "var" / "log" / "x.log").read_text() == line + "\n"
    if format_ == "json":
        assert json.loads(line)["message"] == "hello there"
    else:
        assert line.endswith(" WARNING llmgw.x: hello there")

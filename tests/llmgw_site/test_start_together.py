"""Control planes started at the same instant on one new database all come up.

Each try makes a new database, starts three processes (three "machines": a var folder each) that
wait for one file to appear, makes it, and each then does what the run command does before it
starts anything (llmgw_site.firststart.first_start: migrate, server.yaml, the first admin and its
token, the local node). All three must succeed, and the database must hold one admin, each
migration once, and the routing triggers. Before the start-up lock, the second died on the
admin's unique username and a third in the migrations.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.support.barrier import CHILD_WAIT, StartBarrier
from tests.support.system import ROOT

BASE_URL = os.environ.get("DATABASE_URL", "")
ON_POSTGRESQL = BASE_URL.startswith(("postgres://", "postgresql://"))

TRIES = 10
PLANES = 3
# Tries run two at a time (each on its own database): a try is mostly Python starting.
AT_ONCE = 2
READY_SECONDS = 30

# What one "machine" runs: Django set up (connected to nothing yet), then, when the barrier
# lets all go at once, the run command's first start.
FIRST_START = (
    """
import sys
import django
django.setup()
from llmgw_site.firststart import first_start
"""
    + CHILD_WAIT
    + """
first_start(stdout=sys.stdout, node=True)
"""
)

# The admin command's words the first time, when it made the admin.
MADE_ADMIN = "The password and the token are shown only now"


class Database:
    """A new PostgreSQL database named startup_…, dropped at the end."""

    def __init__(self) -> None:
        parts = urlsplit(BASE_URL)
        self.name = f"startup_{uuid.uuid4().hex[:10]}"
        self.admin_url = urlunsplit(parts._replace(path="/postgres"))
        self.url = urlunsplit(parts._replace(path=f"/{self.name}"))
        self._admin(f'CREATE DATABASE "{self.name}"')

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql)

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def drop(self) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def _environment(var: Path, database_url: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "LLMGW_")) and key != "DJANGO_SETTINGS_MODULE"
    }
    env.update(
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        DATABASE_URL=database_url,
        LLMGW_VAR_DIR=str(var),
        LLMGW_CONFIG=str(var / "server.yaml"),  # none: no declared models
        LLMGW_KICK_RECONCILE="false",
    )
    return env


def start_together(folder: Path, database_url: str, planes: int) -> list[tuple[int, str]]:
    """Start `planes` first starts at the same instant; each one's exit code and output."""
    barrier = StartBarrier(planes)
    processes = []
    for number in range(planes):
        var = folder / f"plane{number}"
        var.mkdir()
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", FIRST_START, *barrier.child_args()],
                cwd=ROOT,
                env=_environment(var, database_url),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=barrier.child_fds(),
            )
        )
    barrier.started()
    barrier.release(timeout=READY_SECONDS)
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=120)
        results.append((process.returncode, out.decode(errors="replace")))
    return results


def one_try(number: int) -> float:
    started = time.monotonic()
    database = Database()
    try:
        with tempfile.TemporaryDirectory(prefix=f"llmgw-start-{number}-") as folder:
            results = start_together(Path(folder), database.url, PLANES)
        for code, out in results:
            assert code == 0, f"try {number}: a control plane failed to start:\n{out}"
        assert sum(MADE_ADMIN in out for _, out in results) == 1, [out for _, out in results]
        assert database.rows("SELECT count(*) FROM auth_user") == [(1,)]
        assert database.rows("SELECT count(*) FROM accounts_apitoken") == [(1,)]
        assert database.rows("SELECT count(*) FROM fleet_node WHERE name = 'local'") == [(1,)]
        twice = database.rows(
            "SELECT app, name FROM django_migrations GROUP BY app, name HAVING count(*) > 1"
        )
        assert twice == []
        assert database.rows("SELECT count(*) FROM django_migrations WHERE app = 'access'") == [
            (len(list((ROOT / "access" / "migrations").glob("0*.py"))),)
        ]
        triggers = {
            name
            for (name,) in database.rows(
                "SELECT tgname FROM pg_trigger WHERE tgname LIKE 'llmgw_routing_%'"
            )
        }
        assert triggers, "no routing triggers"
        assert database.rows("SELECT count(*) FROM gateway_routingversion") == [(1,)]
    finally:
        database.drop()
    return time.monotonic() - started


@pytest.fixture
def timings() -> Iterator[list[float]]:
    found: list[float] = []
    yield found
    if found:
        print(f"\n{len(found)} tries, {max(found):.1f} s the longest, {sum(found):.1f} s in all")


@pytest.mark.skipif(
    not ON_POSTGRESQL,
    reason="control planes share a PostgreSQL database (set DATABASE_URL to postgres://…)",
)
def test_it_brings_up_three_control_planes_started_at_once_ten_times(
    timings: list[float],
) -> None:
    with ThreadPoolExecutor(AT_ONCE) as pool:
        timings.extend(pool.map(one_try, range(TRIES)))
    assert len(timings) == TRIES


def test_it_brings_up_two_run_commands_started_at_once_on_one_sqlite_file(tmp_path: Path) -> None:
    """On one machine (SQLite): the start-up lock is an flock beside the database file."""
    database = tmp_path / "shared.sqlite3"
    results = start_together(tmp_path, f"sqlite:///{database}", 2)
    for code, out in results:
        assert code == 0, out
    assert sum(MADE_ADMIN in out for _, out in results) == 1
    import sqlite3

    with sqlite3.connect(database) as conn:
        assert conn.execute("SELECT count(*) FROM auth_user").fetchone() == (1,)
        assert conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' "
            "AND name LIKE 'llmgw_routing_%'"
        ).fetchone()[0]

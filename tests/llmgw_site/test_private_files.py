"""var/, the SQLite database and every file holding a secret are owner-only whatever the umask."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db.backends.sqlite3.base import DatabaseWrapper

from llmgw_site.private_files import (
    kept_secret,
    owner_only_folder,
    write_secret,
)
from tests.support.system import ROOT

LOOSE_UMASKS = [0o022, 0o000]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=LOOSE_UMASKS, ids=["umask-022", "umask-000"])
def loose_umask(request: Any) -> Iterator[int]:
    """The process's umask set to a loose one for the test (llmgw's settings set 077)."""
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def test_secrets_and_folders_are_owner_only_from_the_start(
    tmp_path: Path, loose_umask: int
) -> None:
    folder = owner_only_folder(tmp_path / "var" / "broker")
    assert mode(folder) == 0o700
    assert kept_secret(folder / "secret-key", lambda: "s3cret") == "s3cret"
    assert mode(folder / "secret-key") == 0o600
    write_secret(folder / "local-node-token", "llmgw_node_abc\n")
    assert mode(folder / "local-node-token") == 0o600
    assert (folder / "local-node-token").read_text() == "llmgw_node_abc\n"
    assert sorted(p.name for p in folder.iterdir()) == ["local-node-token", "secret-key"]


def test_a_kept_secret_is_made_once_and_narrowed_when_left_loose(tmp_path: Path) -> None:
    path = tmp_path / "metrics-token"
    assert kept_secret(path, lambda: "first") == "first"
    assert kept_secret(path, lambda: "second") == "first"
    path.chmod(0o644)  # as an earlier version left it
    assert kept_secret(path, lambda: "third") == "first"
    assert mode(path) == 0o600


def test_a_replaced_secret_is_never_readable_by_others(tmp_path: Path, loose_umask: int) -> None:
    path = tmp_path / "local-node-token"
    path.write_text("old\n")
    path.chmod(0o644)
    write_secret(path, "new\n")
    assert (path.read_text(), mode(path)) == ("new\n", 0o600)


def test_a_var_folder_left_open_is_closed(tmp_path: Path) -> None:
    folder = tmp_path / "var"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    owner_only_folder(folder)
    assert mode(folder) == 0o700


def test_an_sqlite_database_made_through_django_is_owner_only(
    tmp_path: Path, loose_umask: int, django_db_blocker: Any
) -> None:
    # A connection of its own, to a file: the test database is kept in memory. Connecting
    # runs what every process connected at start (llmgw_site.apps) runs.
    database = tmp_path / "llmgw.sqlite3"
    with django_db_blocker.unblock():
        _connect(database)
        assert mode(database) == 0o600
        database.chmod(0o644)  # as an earlier version left it
        _connect(database)
    assert mode(database) == 0o600


def _connect(database: Path) -> None:
    connection = DatabaseWrapper(_sqlite_settings(database), alias="private-files-test")
    try:
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    finally:
        connection.close()


def _sqlite_settings(database: Path) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(database),
        "OPTIONS": {},
        "TIME_ZONE": None,
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
        "AUTOCOMMIT": True,
        "ATOMIC_REQUESTS": False,
        "TEST": {},
    }


@pytest.mark.parametrize("umask", LOOSE_UMASKS, ids=["umask-022", "umask-000"])
def test_a_fresh_installation_is_owner_only(tmp_path: Path, umask: int) -> None:
    """manage.py migrate on a fresh machine, started from a shell with a loose umask."""
    var = tmp_path / "var"
    result = _migrate(var, umask)
    assert result.returncode == 0, result.stderr
    assert mode(var) == 0o700
    assert mode(var / "secret-key") == 0o600
    assert mode(var / "llmgw.sqlite3") == 0o600
    assert {mode(folder) for folder in (var / "broker").rglob("*") if folder.is_dir()} == {0o700}
    assert mode(var / "broker") == 0o700


def test_an_installation_left_readable_is_closed_at_the_next_start(tmp_path: Path) -> None:
    var = tmp_path / "var"
    assert _migrate(var, 0o022).returncode == 0
    for path in (var, var / "broker"):
        path.chmod(0o755)
    for path in (var / "secret-key", var / "llmgw.sqlite3"):
        path.chmod(0o644)
    key = (var / "secret-key").read_text()

    result = _migrate(var, 0o022)
    assert result.returncode == 0, result.stderr
    assert [mode(p) for p in (var, var / "broker")] == [0o700, 0o700]
    assert [mode(p) for p in (var / "secret-key", var / "llmgw.sqlite3")] == [0o600, 0o600]
    assert (var / "secret-key").read_text() == key  # sessions survive


def _migrate(var: Path, umask: int) -> subprocess.CompletedProcess[str]:
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "LLMGW", "PYTEST"))},
        "DATABASE_URL": f"sqlite:///{var / 'llmgw.sqlite3'}",
        "LLMGW_VAR_DIR": str(var),
        "LLMGW_CONFIG": str(var.parent / "server.yaml"),
    }
    environment.pop("REDIS_URL", None)  # the broker kept in files under var/
    return subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v0"],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(umask),
    )


@pytest.mark.django_db
def test_the_run_commands_tokens_are_owner_only(
    tmp_path: Path, settings: Any, monkeypatch: Any, loose_umask: int
) -> None:
    from django.contrib.auth import get_user_model

    from llmgw_site.management.commands.llmgw_run import Command

    get_user_model().objects.create_superuser("root", password="root-password-1")
    settings.VAR_DIR = tmp_path
    # Set first, so that the token the command leaves in the environment goes with the test.
    monkeypatch.setenv("LLMGW_METRICS_TOKEN", "")
    monkeypatch.delenv("LLMGW_METRICS_TOKEN")
    monkeypatch.delenv("LLMGW_METRICS_OPEN", raising=False)
    command = Command()

    command._metrics_token()
    assert mode(tmp_path / "metrics-token") == 0o600
    assert os.environ["LLMGW_METRICS_TOKEN"] == (tmp_path / "metrics-token").read_text().strip()

    token_file = command._local_node()
    assert token_file == tmp_path / "local-node-token"
    assert mode(token_file) == 0o600
    token_file.chmod(0o644)  # as an earlier version left it
    assert mode(command._local_node()) == 0o600

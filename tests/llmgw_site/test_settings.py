"""Where the settings put things when the environment says little: the SQLite database lives in
LLMGW_VAR_DIR with the rest of the state, and stays in the checkout's var/ without it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.support.system import ROOT, run_python

SHOW_DATABASE = (
    "import django; django.setup(); from django.conf import settings; "
    "print(settings.DATABASES['default']['NAME'])"
)


def environment(**values: str) -> dict[str, str]:
    """This environment without DATABASE_URL or any LLMGW_ setting, plus `values`."""
    kept = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO", "LLMGW", "PYTEST", "DATABASE_URL"))
    }
    return {
        **kept,
        "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
        "LLMGW_SECRET_KEY": "test-secret-key-for-settings-tests",
        "LLMGW_CONFIG": "/nonexistent/server.yaml",
        **values,
    }


def database_name(env: dict[str, str]) -> str:
    result = run_python(SHOW_DATABASE, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_database_follows_the_var_dir(tmp_path: Path) -> None:
    # A name that a URL would read otherwise: the default URL is quoted.
    var = tmp_path / "var #1 %20?"
    env = environment(LLMGW_VAR_DIR=str(var))
    assert database_name(env) == str(var / "llmgw.sqlite3")
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v0"], env=env, cwd=ROOT, check=True, timeout=300
    )
    with sqlite3.connect(var / "llmgw.sqlite3") as database:
        tables = {row[0] for row in database.execute("SELECT name FROM sqlite_master")}
    assert "catalog_model" in tables


def test_without_a_var_dir_it_stays_in_the_checkouts_var() -> None:
    """Where every earlier version kept it, so that an existing install keeps its data."""
    assert database_name(environment()) == str(ROOT.resolve() / "var" / "llmgw.sqlite3")


def test_database_url_still_wins(tmp_path: Path) -> None:
    env = environment(
        LLMGW_VAR_DIR=str(tmp_path / "var"), DATABASE_URL=f"sqlite:///{tmp_path / 'other.db'}"
    )
    assert database_name(env) == str(tmp_path / "other.db")

"""Settings read from environment variables, and the rules for reading one value.

Each helper fails loudly, naming the variable and what it expected: a typo in a
deployment's environment should stop the process at start, not quietly fall
back to a default that nobody asked for. The site's settings (llmgw_site.settings)
read the environment through the env_* helpers; the gateway's settings
(gateway.conf, read when used) parse theirs with the same parse_* rules.
This module does not import Django: settings.py imports it before Django is set up.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit


class EnvError(Exception):
    pass


def parse_bool(name: str, raw: str) -> bool:
    """A yes/no value as people write it (true/false, yes/no, on/off, 1/0)."""
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise EnvError(f"{name}={raw!r} is not a yes/no value: use true or false.")


def parse_number(name: str, raw: object, *, minimum: float | None = None) -> float:
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EnvError(f"{name}={raw!r} is not a number.") from None
    if minimum is not None and value < minimum:
        raise EnvError(f"{name}={raw!r} is below the smallest allowed value, {minimum}.")
    return value


def parse_whole(name: str, raw: object, *, minimum: int | None = None) -> int:
    try:
        value = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise EnvError(f"{name}={raw!r} is not a whole number.") from None
    if minimum is not None and value < minimum:
        raise EnvError(f"{name}={value} is below the smallest allowed value, {minimum}.")
    return value


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return parse_bool(name, raw)


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return parse_whole(name, raw, minimum=minimum)


def env_list(name: str, default: list[str] | None = None) -> list[str] | None:
    """A comma-separated list; None when the variable is unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def database_from_url(url: str, *, base_dir: Path) -> dict[str, object]:
    """Django's DATABASES entry for a sqlite:/// or postgres:// URL."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        # sqlite:///relative/path, sqlite:////absolute/path, sqlite:///:memory:
        path = unquote(parts.path[1:]) if parts.path.startswith("/") else unquote(parts.path)
        if not path:
            raise EnvError(f"DATABASE_URL={url!r} names no file: use sqlite:///var/llmgw.sqlite3.")
        name = path if path == ":memory:" or Path(path).is_absolute() else str(base_dir / path)
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": name,
            # A busy web process and worker share the file: wait for the lock
            # instead of failing with "database is locked".
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
            "CONN_MAX_AGE": 60,
            "TEST": {"NAME": None},
        }
    if parts.scheme in {"postgres", "postgresql", "pgsql"}:
        if not parts.path.strip("/"):
            raise EnvError(f"DATABASE_URL={url!r} names no database: end it with /DBNAME.")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "CONN_MAX_AGE": 60,
            # A kept connection is checked before a request reuses it. Without it, after the
            # server restarts every kept connection fails its next request once (a 500 for each
            # of the web's threads, heartbeats included), as the fault matrix found.
            "CONN_HEALTH_CHECKS": True,
        }
    raise EnvError(
        f"DATABASE_URL={url!r} is not understood: use sqlite:///PATH or "
        "postgres://USER:PASSWORD@HOST:PORT/DBNAME."
    )

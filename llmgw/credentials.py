"""The API tokens `llmgw ctl login` keeps, one per control plane, in a file only its owner reads.

`$XDG_CONFIG_HOME/llmgw/login.json` (else `~/.config/llmgw/login.json`), mode 0600 in a 0700
folder, written whole to a new file and renamed over the old one, so that a command killed
half-way leaves the old file or the new one. A token is only ever sent to the control plane it
was issued by (its URL is the key), and one past its expiry is not sent at all. A file that
others may read is not read (its token may be known to them): the commands say so and how to
fix it. LLMGW_TOKEN and `--token` come first, so scripts keep the tokens they have.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# The file is ours, but a hand-edited one may be anything: read at most this much of it.
MAX_FILE_BYTES = 1 << 20


class CredentialsError(Exception):
    """The file cannot be used; worded for the terminal."""


def login_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw" / "login.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        info = path.stat()
    except FileNotFoundError:
        return {}
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialsError(
            f"{path} may be read by others (mode {stat.filemode(info.st_mode)}), so its tokens "
            f"are not used: run `chmod 600 {path}` if only you could have read it, else "
            "`llmgw ctl logout` and sign in again"
        )
    with path.open("rb") as handle:
        raw = handle.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise CredentialsError(f"{path} is larger than a login file can be; remove it")
    try:
        data = json.loads(raw)
    except ValueError:
        raise CredentialsError(f"{path} is not JSON; remove it and sign in again") from None
    logins = data.get("logins") if isinstance(data, dict) else None
    return logins if isinstance(logins, dict) else {}


def _write(path: Path, logins: dict[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump({"logins": logins}, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def save(url: str, *, token: str, username: str, expires_at: str | None) -> Path:
    """Keep `token` for the control plane at `url`, replacing the one kept for it."""
    path = login_file()
    try:
        logins = _read(path)
    except CredentialsError:
        logins = {}  # written anew, owner-only; the old tokens were not safe to keep
    logins[url] = {"token": token, "username": username, "expires_at": expires_at}
    _write(path, logins)
    return path


def token_for(url: str, *, now: datetime | None = None) -> str | None:
    """The unexpired token kept for `url`, or None."""
    entry = _read(login_file()).get(url)
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        return None
    expires = entry.get("expires_at")
    if isinstance(expires, str):
        try:
            if datetime.fromisoformat(expires) <= (now or datetime.now(UTC)):
                return None
        except ValueError:
            return None
    return entry["token"]


def forget(url: str) -> dict[str, Any] | None:
    """Drop the login kept for `url`; what it was, or None when there was none."""
    path = login_file()
    logins = _read(path)
    entry = logins.pop(url, None)
    if entry is not None:
        _write(path, logins)
    return entry if isinstance(entry, dict) else None

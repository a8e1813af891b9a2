"""A PostgreSQL server of a test's own, for tests that stop and start the database.

initdb makes a cluster in a temporary folder, and the server listens on a free port of 127.0.0.1
only (no socket elsewhere). It runs as the `postgres` user when the tests run as root, since
PostgreSQL refuses to run as root. `stop()` and `start()` may be called any number of times;
`close()` stops it by its pid and removes its folder. Never the machine's own service.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.support.system import free_port, wait_for


def _bin_dir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def _server_user_exists() -> bool:
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return False
    return True


BIN = _bin_dir()
# PostgreSQL refuses to run as root: as root, the tests run it as the postgres user.
AVAILABLE = BIN is not None and (os.geteuid() != 0 or _server_user_exists())


def _as_server_user() -> list[str]:
    """The prefix that runs a command as a user PostgreSQL accepts."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


class PostgresServer:
    def __init__(self) -> None:
        assert BIN is not None, "PostgreSQL's programs (initdb, pg_ctl) are not installed"
        # A folder of its own right under the temporary root: pytest's are root's alone (0700),
        # and the server's user must reach its folder. Removed by close().
        self.folder = Path(tempfile.mkdtemp(prefix="llmgw-test-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.folder, user.pw_uid, user.pw_gid)
        subprocess.run(
            [
                *_as_server_user(),
                str(BIN / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    @property
    def admin_url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def pid(self) -> int | None:
        pid_file = self.data / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, PermissionError):
            return int(pid_file.read_text().splitlines()[0])
        return None

    def start(self) -> None:
        subprocess.run(
            [
                *_as_server_user(),
                str(BIN / "pg_ctl"),  # type: ignore[operator]
                "-D",
                str(self.data),
                "-l",
                str(self.folder / "server.log"),
                "-o",
                f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c fsync=off",
                "-w",
                "start",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(self._answers, timeout=30, interval=0.1, what="the test's PostgreSQL")

    def _answers(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.admin_url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def stop(self) -> None:
        """A fast shutdown: every client's connection is closed, as when the server goes away."""
        subprocess.run(
            [
                *_as_server_user(),
                str(BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-m",
                "fast",
                "-w",
                "stop",
            ],  # type: ignore[operator]
            check=True,
            capture_output=True,
            timeout=60,
        )

    def close(self) -> None:
        try:
            self._kill()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _kill(self) -> None:
        pid = self.pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)  # immediate shutdown
        try:
            wait_for(lambda: _gone(pid), timeout=10, what="PostgreSQL to exit on SIGQUIT")
        except AssertionError:  # it did not exit: kill it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False

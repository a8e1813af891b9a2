"""A PostgreSQL server of a test's own, for tests that stop and start the database.

initdb makes a cluster in a temporary folder, and the server listens on a free port of 127.0.0.1
only (no socket elsewhere). It runs as the `postgres` user when the tests run as root, since
PostgreSQL refuses to run as root. `stop()` and `start()` may be called any number of times;
`close()` stops it by its pid and removes its folder. Never the machine's own service.

`start_standby()` makes a streaming standby of it (pg_basebackup) on another port, and
`fail_over()` then stops this server and promotes the standby on this server's port: the same
address, a new timeline, the old data folder gone, as when a replicated PostgreSQL fails over.
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
        # Where the programs are (a pg_ctl on the PATH may be a link to them): pg_basebackup
        # is beside them, not always beside the link.
        return Path(found).resolve().parent
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
        self.standby: tuple[Path, int] | None = None  # its data folder and port
        self.generation = 0  # data folders made by start_standby
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

    def pid(self, data: Path | None = None) -> int | None:
        pid_file = (data or self.data) / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, PermissionError):
            return int(pid_file.read_text().splitlines()[0])
        return None

    def start(self) -> None:
        self._pg_ctl_start(self.data, self.port)
        wait_for(
            lambda: self._answers(self.admin_url),
            timeout=30,
            interval=0.1,
            what="the test's PostgreSQL",
        )

    def _pg_ctl_start(self, data: Path, port: int) -> None:
        subprocess.run(
            [
                *_as_server_user(),
                str(BIN / "pg_ctl"),  # type: ignore[operator]
                "-D",
                str(data),
                "-l",
                str(self.folder / f"server-{data.name}.log"),
                "-o",
                f"-p {port} -c listen_addresses=127.0.0.1 -k {self.folder} -c fsync=off",
                "-w",
                "start",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

    @staticmethod
    def _answers(url: str) -> bool:
        import psycopg

        try:
            with psycopg.connect(url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def stop(self) -> None:
        """A fast shutdown: every client's connection is closed, as when the server goes away."""
        self._pg_ctl_stop(self.data)

    def _pg_ctl_stop(self, data: Path) -> None:
        subprocess.run(
            [*_as_server_user(), str(BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],  # type: ignore[operator]
            check=True,
            capture_output=True,
            timeout=60,
        )

    # -- a standby, and a fail-over to it --------------------------------------------------

    def query(self, sql: str) -> object:
        """The first column of the first row `sql` answers, on the server at this port."""
        import psycopg

        with psycopg.connect(self.admin_url, connect_timeout=5) as conn:
            row = conn.execute(sql).fetchone()
        return row[0] if row else None

    def start_standby(self) -> None:
        """A copy of this server (pg_basebackup) running as its streaming standby on a port of
        its own, until fail_over() promotes it. The copy is taken while the server runs;
        what is written afterwards streams to it."""
        assert self.standby is None, "a standby runs already"
        self.generation += 1
        standby = self.folder / f"data-{self.generation}"
        subprocess.run(
            [
                *_as_server_user(),
                str(BIN / "pg_basebackup"),  # type: ignore[operator]
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-D",
                str(standby),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        port = free_port()
        self._pg_ctl_start(standby, port)
        self.standby = (standby, port)
        url = f"postgres://postgres@127.0.0.1:{port}/postgres"
        wait_for(lambda: self._answers(url), timeout=30, interval=0.1, what="the standby")

    def fail_over(self) -> None:
        """Stop this server for good and promote its standby on this server's port.

        A fast shutdown sends the standby everything written before it (its last checkpoint
        included) before the server exits, so nothing committed is lost. The standby is then
        stopped, told of no primary any more and started on this port, still in recovery, and
        promoted there: a new timeline. Its data folder becomes this server's; the old one is
        removed."""
        assert self.standby is not None, "no standby: start_standby() first"
        standby, _port = self.standby
        old = self.data
        self._pg_ctl_stop(old)
        self._pg_ctl_stop(standby)
        settings = standby / "postgresql.auto.conf"
        kept = [line for line in settings.read_text().splitlines()
                if not line.startswith("primary_conninfo")]  # fmt: skip
        settings.write_text("\n".join(kept) + "\n")
        self.data, self.standby = standby, None
        self._pg_ctl_start(standby, self.port)
        subprocess.run(
            [*_as_server_user(), str(BIN / "pg_ctl"), "-D", str(standby), "-w", "promote"],  # type: ignore[operator]
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(
            lambda: (
                self._answers(self.admin_url) and self.query("SELECT pg_is_in_recovery()") is False
            ),
            timeout=30,
            interval=0.1,
            what="the promoted standby to take writes",
        )
        shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        try:
            if self.standby is not None:
                self._kill(self.standby[0])
            self._kill(self.data)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _kill(self, data: Path) -> None:
        pid = self.pid(data)
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

"""Two control planes on one PostgreSQL database and one Redis: two run commands, each with its own
folder and ports (two "machines"), real processes throughout.

Exactly one beat sends; when its machine dies (every process of it SIGKILLed) the other takes the
schedule over within 30 s, and a periodic task (`probe`, every 2 s, tests.support.periodic_site)
runs neither twice nor with a gap longer than its interval outside the takeover. Both machines'
web and gateway processes answer throughout. The test makes its own database (named after
DATABASE_URL's, with a suffix) and its own redis-server, and removes both.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import pytest
import requests

from tests.support.redis_server import RedisServer
from tests.support.system import ROOT, free_port, wait_for

BASE_URL = os.environ.get("DATABASE_URL", "")
pytestmark = [
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.skipif(
        not BASE_URL.startswith(("postgres://", "postgresql://")),
        reason="two control planes share a PostgreSQL database (DATABASE_URL)",
    ),
]

PROBE_SECONDS = 2.0  # tests.support.periodic_site
TAKEOVER_LIMIT = 30.0
# How late after its due time a beat may send, on a loaded machine (a skipped send would show
# as a gap of two intervals).
SEND_SLACK = 1.5
# The claim lets a send follow the last one by its interval less this (llmgw_site.leader).
CLAIM_TOLERANCE = 1.0
RUN = [sys.executable, "manage.py", "llmgw_run", "--no-node", "--no-demo"]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class Database:
    def __init__(self) -> None:
        parts = urlsplit(BASE_URL)
        self.name = f"{parts.path.strip('/') or 'llmgw'}_cp_{uuid.uuid4().hex[:8]}"
        self.admin_url = urlunsplit(parts._replace(path="/postgres"))
        self.url = urlunsplit(parts._replace(path=f"/{self.name}"))
        self.admin(f'CREATE DATABASE "{self.name}"')

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql)

    def admin_in_own(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql)

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(sql, params).fetchall()

    def drop(self) -> None:
        self.admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


class ControlPlane:
    """One machine: `manage.py llmgw_run --no-node --no-demo --bind ADDRESS` with a folder and
    an address of its own."""

    def __init__(self, name: str, folder: Path, shared: dict[str, str]) -> None:
        self.name = name
        self.folder = folder
        folder.mkdir(parents=True)
        (folder / "server.yaml").write_text("cluster:\n  reconcile_interval: 1s\n")
        # Its own address; LLMGW_PUBLIC_URL (shared) names the load balancer in front of both.
        self.bind = f"127.0.0.1:{free_port()}"
        self.url = f"http://{self.bind}"
        self.log = folder / "run.log"
        self.env = {
            **shared,
            "LLMGW_VAR_DIR": str(folder / "var"),
            "LLMGW_CONFIG": str(folder / "server.yaml"),
            "LLMGW_METRICS_OPEN": "true",
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [*RUN, "--bind", self.bind],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_up(self, token: str) -> None:
        assert self.process is not None
        wait_for(
            lambda: (
                self.process.poll() is None  # type: ignore[union-attr]
                and requests.get(
                    f"{self.url}/api/v1/models",
                    headers={"Authorization": f"Token {token}"},
                    timeout=3,
                ).ok
            ),
            timeout=180,
            interval=0.5,
            what=f"control plane {self.name} at {self.url} (log: {self.log})",
        )

    def pids(self) -> set[int]:
        if self.process is None or self.process.poll() is not None:
            return set()
        return {self.process.pid, *_descendants(self.process.pid)}

    def kill(self) -> None:
        """The machine dies: every process of it at once, with no chance to clean up."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)

    def terminate(self) -> None:
        """A clean stop (SIGTERM), not waited for."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process is None:
            return
        leftovers = self.pids()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=60)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Database, ControlPlane, ControlPlane]]:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    database = Database()
    # tests.support.periodic_probe writes each run here.
    database.admin_in_own(
        "CREATE TABLE probe_run (id serial PRIMARY KEY, send bigint, sent_at timestamptz, "
        "beat text, worker text, ran_at timestamptz NOT NULL)"
    )
    shared = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "LLMGW", "PYTEST"))},
        "DJANGO_SETTINGS_MODULE": "tests.support.periodic_site",
        "DATABASE_URL": database.url,
        "REDIS_URL": redis.url,
        "LLMGW_CELERY_QUEUE": f"llmgw-cp-{uuid.uuid4().hex[:8]}",
        # Shared by every machine of an installation, as sessions and signed values need.
        "LLMGW_SECRET_KEY": "test-secret-key-shared-by-two-control-planes",
        # What people and nodes are told to use: a load balancer in front of both machines
        # (the mirror's file URLs are built on it, so every machine must name the same one).
        # None runs in this test, which talks to each machine at its own address.
        "LLMGW_PUBLIC_URL": f"http://127.0.0.1:{free_port()}",
    }
    one = ControlPlane("one", tmp_path / "one", shared)
    two = ControlPlane("two", tmp_path / "two", shared)
    try:
        yield database, one, two
    finally:
        for plane in (one, two):
            plane.stop()
        redis.stop()
        database.drop()


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Node agents a test starts, stopped at its end (before the control planes)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for agent in started:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=15)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def _holder(database: Database) -> tuple[str, int, bool] | None:
    rows = database.rows(
        "SELECT holder, term, expires_at > statement_timestamp() FROM llmgw_site_lease "
        "WHERE name = 'beat'"
    )
    return rows[0] if rows else None


def _owner(holder: str, planes: tuple[ControlPlane, ...]) -> ControlPlane:
    pid = int(holder.split(":")[1])
    [owner] = [plane for plane in planes if pid in plane.pids()]
    return owner


class Run(NamedTuple):
    send: int
    beat: str
    sent: float  # seconds since the epoch, by the database's clock
    ran: float


def _runs(database: Database) -> list[Run]:
    """The probe's runs in the order they were sent."""
    return [
        Run(send, beat, float(sent), float(ran))
        for send, beat, sent, ran in database.rows(
            "SELECT send, beat, extract(epoch from sent_at), extract(epoch from ran_at) "
            "FROM probe_run ORDER BY sent_at, id"
        )
    ]


def _gaps(runs: list[Run]) -> list[float]:
    """Seconds between consecutive sends."""
    return [round(b.sent - a.sent, 2) for a, b in itertools.pairwise(runs)]


def test_one_beat_leads_and_the_other_takes_over_within_30_s(
    cluster: tuple[Database, ControlPlane, ControlPlane], agents: list[subprocess.Popen[bytes]]
) -> None:
    database, one, two = cluster
    one.start()
    token_line = wait_for(
        lambda: re.search(r"LLMGW_TOKEN=(\w+)", one.text()), timeout=120, what="the admin token"
    )
    token = token_line.group(1)
    one.wait_up(token)
    two.start()
    two.wait_up(token)
    planes = (one, two)

    # -- exactly one leader ----------------------------------------------------------------
    wait_for(lambda: len(_runs(database)) >= 3, timeout=60, what="three runs of the probe")
    both_up = time.time()
    wait_for(
        lambda: len([run for run in _runs(database) if run.sent >= both_up]) >= 3,
        timeout=60,
        interval=0.5,
        what="three runs of the probe sent since both machines were up",
    )
    held = _holder(database)
    assert held is not None and held[2], held
    leader_holder = held[0]
    leading = _owner(leader_holder, planes)
    standing = two if leading is one else one
    wait_for(
        lambda: "beat: standing by; " + leader_holder in standing.text(),
        timeout=30,
        what=f"{standing.name}'s beat to find the lease held and stand by",
    )
    assert "runs the schedule now" in leading.text()
    assert "beat: standing by; " + leader_holder in standing.text()
    assert "runs the schedule now" not in standing.text()
    steady = [run for run in _runs(database) if run.sent >= both_up]
    assert len(steady) >= 3
    assert {run.beat for run in steady} == {leader_holder}  # the standby sent nothing

    # -- both machines serve: the web (API) and the gateway (/v1/, a key made on the other) ---
    for plane in planes:
        # The load balancer's health check in the README: through the gateway to the web.
        assert requests.get(f"{plane.url}/admin/login/", timeout=10).status_code == 200
    key = requests.post(
        f"{leading.url}/api/v1/keys",
        json={"name": "both"},
        headers={"Authorization": f"Token {token}"},
        timeout=30,
    ).json()["key"]
    for plane in planes:
        wait_for(
            lambda plane=plane: (
                requests.get(
                    f"{plane.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5
                ).status_code
                == 200
            ),
            timeout=30,
            what=f"{plane.name}'s gateway to know the new key",
        )

    # -- the leader's beat pauses past its lease (a stopped VM, a long pause): the other takes
    #    the schedule over, and the paused one, woken believing it leads, sends nothing ----------
    first_holder = leader_holder
    beat_pid = int(leader_holder.split(":")[1])
    os.kill(beat_pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        paused_taken = wait_for(
            lambda: (h := _holder(database)) is not None and h[0] != leader_holder and h[2] and h,
            timeout=TAKEOVER_LIMIT + 10,
            interval=0.2,
            what="the standby to take the lease from the paused beat",
        )
        pause_takeover = time.monotonic() - paused_at
        wait_for(
            lambda: any(run.beat == paused_taken[0] for run in _runs(database)),
            timeout=30,
            interval=0.2,
            what="the probe's first run sent by the beat that took over",
        )
    finally:
        os.kill(beat_pid, signal.SIGCONT)
    wait_for(
        lambda: (
            f"beat: {leader_holder} lost the lease to {paused_taken[0]}; standing by"
            in leading.text()
        ),
        timeout=30,
        what="the woken beat to stand by",
    )
    # Whatever the woken beat sent on waking is in the queue before what the new leader sends
    # from now on: once two of those ran, so did it.
    stood_by = time.time()
    wait_for(
        lambda: (
            len([r for r in _runs(database) if r.beat == paused_taken[0] and r.sent >= stood_by])
            >= 2
        ),
        timeout=30,
        interval=0.5,
        what="two probe runs sent by the new leader since the woken beat stood by",
    )
    runs = _runs(database)
    took_over = min(run.sent for run in runs if run.beat == paused_taken[0])
    assert all(run.sent < took_over for run in runs if run.beat == leader_holder)
    # The roles swap.
    held, leader_holder = paused_taken, paused_taken[0]
    leading, standing = standing, leading

    # -- a node agent given both addresses, the leader's first -------------------------------
    node_token = requests.post(
        f"{leading.url}/api/v1/nodes",
        json={"name": "n1"},
        headers={"Authorization": f"Token {token}"},
        timeout=30,
    ).json()["token"]
    agent_log = leading.folder.parent / "agent.log"
    with agent_log.open("wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "node", "--server", leading.url, "--server",
             standing.url, "--memory", "1", "--cores", "1", "--cache",
             str(leading.folder.parent / "node"), "--port-range", "47100-47109"],
            cwd=ROOT,
            env={**one.env, "LLMGW_NODE_TOKEN": node_token, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    agents.append(agent)

    def last_heartbeat(plane: ControlPlane) -> float:
        nodes = requests.get(
            f"{plane.url}/api/v1/nodes", headers={"Authorization": f"Token {token}"}, timeout=5
        ).json()
        [node] = [node for node in nodes if node["name"] == "n1"]
        stamp = node["last_heartbeat"]
        return datetime.fromisoformat(stamp).timestamp() if stamp else 0.0

    wait_for(lambda: last_heartbeat(standing) > 0, timeout=60, what="the node's first heartbeat")

    # -- the leader's machine dies ---------------------------------------------------------
    killed_at = time.monotonic()
    killed_wall = time.time()
    leading.kill()
    taken = wait_for(
        lambda: (h := _holder(database)) is not None and h[0] != leader_holder and h[2] and h,
        timeout=TAKEOVER_LIMIT + 10,
        interval=0.2,
        what="the standby to take the lease",
    )
    takeover = time.monotonic() - killed_at
    new_holder = taken[0]
    assert _owner(new_holder, planes) is standing
    assert taken[1] == held[1] + 1  # a new term
    wait_for(
        lambda: any(run.beat == new_holder for run in _runs(database)),
        timeout=30,
        interval=0.2,
        what="the probe's first run sent by the new leader",
    )
    first_run = time.monotonic() - killed_at
    # (The new leader may be the beat that was paused, which led before: its runs since the kill.)
    wait_for(
        lambda: (
            len([r for r in _runs(database) if r.beat == new_holder and r.sent >= killed_wall]) >= 5
        ),
        timeout=60,
        interval=0.5,
        what="five probe runs sent by the new leader since the kill",
    )

    # -- the runs: none twice, none skipped past one interval outside the takeover -----------
    runs = _runs(database)
    sends = [run.send for run in runs]
    assert None not in sends
    assert len(sends) == len(set(sends)), f"a send ran twice: {sends}"
    assert sends == sorted(sends)
    # Each leader sent in one stretch, one after the other: never two at once.
    stretches = [list(group) for _, group in itertools.groupby(runs, key=lambda run: run.beat)]
    assert [stretch[0].beat for stretch in stretches] == [first_holder, leader_holder, new_holder]
    for stretch in stretches:
        gaps = _gaps(stretch)
        # Never twice within an interval, never a send skipped.
        assert min(gaps) >= PROBE_SECONDS - CLAIM_TOLERANCE, gaps
        assert max(gaps) <= PROBE_SECONDS + SEND_SLACK, gaps
    outages = [b[0].sent - a[-1].sent for a, b in itertools.pairwise(stretches)]
    assert max(outages) <= TAKEOVER_LIMIT + PROBE_SECONDS, outages
    before, after = stretches[1], stretches[2]
    assert len(after) >= 5
    outage = outages[1]
    # The schedule's own tasks moved over too.
    moved = dict(
        database.rows(
            "SELECT name, sent_by FROM llmgw_site_periodicrun WHERE sent_at > to_timestamp(%s)",
            killed_wall,
        )
    )
    assert moved.get("reconcile") == new_holder
    assert moved.get("advance-rollouts") == new_holder

    # The node moved to the survivor.
    wait_for(
        lambda: last_heartbeat(standing) > killed_wall + 1,
        timeout=30,
        what="a heartbeat from the node after the kill",
    )
    assert f"heartbeating to the control plane at {standing.url} from now on" in (
        agent_log.read_text()
    )
    assert agent.poll() is None

    # The surviving machine still serves.
    assert requests.get(
        f"{standing.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5
    ).ok

    # -- the dead machine comes back and stands by; a clean stop of the leader hands over ------
    # (The new leader is the beat that was paused: it may have stood by for this one before.)
    said_before = leading.text().count("beat: standing by; " + new_holder)
    leading.start()
    leading.wait_up(token)
    wait_for(
        lambda: leading.text().count("beat: standing by; " + new_holder) > said_before,
        timeout=60,
        what="the restarted machine's beat to stand by",
    )
    assert _holder(database)[0] == new_holder  # type: ignore[index]
    stopped_at = time.monotonic()
    standing.terminate()
    handed = wait_for(
        lambda: (h := _holder(database)) is not None and h[0] != new_holder and h[2] and h,
        timeout=TAKEOVER_LIMIT,
        interval=0.2,
        what="the restarted machine to take the lease",
    )
    handover = time.monotonic() - stopped_at
    assert _owner(handed[0], (leading,)) is leading
    assert "released the lease" in wait_for(
        lambda: "released the lease" in standing.text() and standing.text(), timeout=30
    )
    # Released on a clean stop: no need to wait for the lease to run out.
    assert handover < 10, handover
    wait_for(
        lambda: any(run.beat == handed[0] for run in _runs(database)),
        timeout=30,
        what="a probe run sent by the restarted machine",
    )
    sends = [run.send for run in _runs(database)]
    assert len(sends) == len(set(sends)), f"a send ran twice: {sends}"
    gaps = [gap for stretch in stretches for gap in _gaps(stretch)]
    print(
        f"\ntakeover from a paused beat: {pause_takeover:.1f} s after the pause; {outages[0]:.1f} "
        f"s between the last send before and the first after.\n"
        f"takeover after a kill: lease taken {takeover:.1f} s after it, first probe run by the "
        f"new leader {first_run:.1f} s after; {outage:.1f} s between the last send before and "
        f"the first after; runs before {len(before)}, after {len(after)}; sends otherwise "
        f"{min(gaps):.2f}-{max(gaps):.2f} s apart.\nhandover on a clean stop (SIGTERM): "
        f"{handover:.1f} s"
    )

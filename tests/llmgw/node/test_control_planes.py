"""A node agent given several control planes (--server, more than once) heartbeats to whichever
answers: the real agent as a subprocess, fake control planes (tests.support.fake_control_plane)
and a port where nothing listens for a control plane that is down. No engine runs here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_control_plane import FakeControlPlane, fake_control_plane
from tests.support.waiting import stays, wait_for

REPO = Path(__file__).resolve().parents[3]
TOKEN = "node-token-1"


def _closed_port() -> int:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        return int(placeholder.getsockname()[1])


class AgentProcess:
    def __init__(self, tmp_path: Path, *servers: str) -> None:
        self.log = tmp_path / "agent.log"
        command = [sys.executable, "-m", "llmgw", "node"]
        for server in servers:
            command += ["--server", server]
        command += ["--memory", "4", "--cores", "2", "--cache", str(tmp_path / "cache")]
        command += ["--port-range", "47000-47009", "--heartbeat-interval", "0.2"]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "LLMGW_NODE_TOKEN": TOKEN},
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def planes() -> Iterator[tuple[FakeControlPlane, FakeControlPlane]]:
    with fake_control_plane(TOKEN) as one, fake_control_plane(TOKEN) as two:
        yield one, two


@pytest.fixture
def start(tmp_path: Path) -> Iterator[object]:
    started: list[AgentProcess] = []

    def run(*servers: str) -> AgentProcess:
        agent = AgentProcess(tmp_path, *servers)
        started.append(agent)
        return agent

    yield run
    for agent in started:
        agent.stop()


def test_it_heartbeats_to_the_second_when_the_first_is_down(
    planes: tuple[FakeControlPlane, FakeControlPlane], start: object
) -> None:
    _, second = planes
    down = f"http://127.0.0.1:{_closed_port()}"
    agent = start(down, second.url)  # type: ignore[operator]

    second.wait_for(lambda report: True, what="a heartbeat at the second control plane")
    count = second.count()
    second.wait_for(lambda report: True, since=count, what="the heartbeats going on")
    assert second.heartbeats[-1].authorization == f"Bearer {TOKEN}"
    wait_for(lambda: "from now on" in agent.output(), timeout=10, what="the switch said")
    assert (
        f"heartbeating to the control plane at {second.url} from now on ({down}: nothing answered)"
    ) in agent.output()
    # It stays with the one that answers instead of asking the dead one first each time.
    assert agent.output().count("from now on") == 1
    assert agent.process.poll() is None


def test_it_moves_on_when_the_one_in_use_answers_with_a_server_error_and_back_later(
    planes: tuple[FakeControlPlane, FakeControlPlane], start: object
) -> None:
    first, second = planes
    start(first.url, second.url)  # type: ignore[operator]
    first.wait_for(lambda report: True, what="a heartbeat at the first control plane")
    assert second.count() == 0  # the first answers: the second is not asked

    # The first machine's gateway answers, but its web process is gone.
    first.answer_with(502, {"error": {"message": "the web process did not answer"}})
    second.wait_for(lambda report: True, what="the heartbeats moving to the second")
    at_first = first.count()
    # It stays with the second while it answers: its next five heartbeats (a second's worth),
    # and none to the first meanwhile.
    second.wait_for(
        lambda report: True, since=second.count() + 4, what="five more heartbeats at the second"
    )
    assert first.count() == at_first

    # The second one now fails; the first answers again: back to the first.
    first.answer_normally()
    second.answer_with(503, "unavailable")
    first.wait_for(lambda report: True, since=at_first, what="the heartbeats back at the first")


def test_it_says_once_when_no_control_plane_answers_and_keeps_trying(
    planes: tuple[FakeControlPlane, FakeControlPlane], start: object, tmp_path: Path
) -> None:
    one, two = f"http://127.0.0.1:{_closed_port()}", f"http://127.0.0.1:{_closed_port()}"
    agent = start(f"{one},{two}")  # type: ignore[operator]

    wait_for(lambda: "cannot reach any" in agent.output(), timeout=20, what="the line")
    line = (
        f"cannot reach any of the control planes ({one}: nothing answered; {two}: nothing "
        "answered). Keeping the engines running and trying again."
    )
    # Time is what is tested: closed ports show no attempt, so a few more rounds are a second
    # in which the agent keeps going and says nothing again.
    stays(
        lambda: agent.process.poll() is None and agent.output().count(line) == 1,
        seconds=1.0,
        what="the agent running, having said it once",
    )

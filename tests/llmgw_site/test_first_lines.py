"""What a newcomer reads at the first start: no warning from the embedded broker, no node agent
saying the control plane is unreachable while it is starting, and hints that name the command
as it was typed."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from llmgw.ctl.output import program
from llmgw_site.management.commands.llmgw_run import Child, Supervisor
from tests.support.system import ROOT


def test_the_embedded_broker_connects_without_a_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from kombu import Connection

    from llmgw_site.broker import ALIAS

    folders = {name: tmp_path / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir()
    options = {
        "data_folder_in": str(folders["queue"]),
        "data_folder_out": str(folders["queue"]),
        "processed_folder": str(folders["processed"]),
        "control_folder": str(folders["control"]),
    }
    with (
        caplog.at_level(logging.WARNING),
        Connection(f"{ALIAS}://", transport_options=options) as connection,
    ):
        queue = connection.SimpleQueue("probe")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}
        queue.close()
        connection.as_uri()
    assert not [r for r in caplog.records if r.name.startswith("kombu")]


def test_the_node_starts_once_the_gateway_answers(tmp_path: Path) -> None:
    supervisor = Supervisor(None, None)
    supervisor.stdout = type("Out", (), {"write": lambda self, text: None})()
    up = threading.Event()
    mark = tmp_path / "started"
    node = Child("node", ["sh", "-c", f"touch {mark}; sleep 30"])
    supervisor.start_when(node, up)
    try:
        assert supervisor._tend(time.monotonic()) is None
        assert node.process is None and "node" not in supervisor.children
        up.set()
        assert supervisor._tend(time.monotonic()) is None
        assert node.process is not None and supervisor.children["node"] is node
        assert supervisor.waiting == []
    finally:
        supervisor.stop_all()


@pytest.mark.parametrize(
    ("argv0", "path", "shown"),
    [
        (".venv/bin/llmgw", "/usr/bin:/bin", ".venv/bin/llmgw"),  # as the README types it
        (".venv/bin/llmgw", f"{ROOT / '.venv' / 'bin'}:/usr/bin", "llmgw"),  # on the PATH
        (str(ROOT / "llmgw" / "__main__.py"), "/usr/bin", "llmgw"),  # python -m llmgw
    ],
)
def test_hints_name_the_command_as_it_was_typed(
    monkeypatch: pytest.MonkeyPatch, argv0: str, path: str, shown: str
) -> None:
    if not (ROOT / ".venv" / "bin" / "llmgw").exists():
        pytest.skip("no .venv/bin/llmgw (make setup installs it)")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [argv0, "ctl", "scale"])
    monkeypatch.setenv("PATH", path)
    assert program() == shown
    assert os.environ["PATH"] == path

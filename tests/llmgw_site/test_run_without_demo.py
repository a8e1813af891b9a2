"""When the run command leaves its demo out, and that it goes on without it: a registry the user
named (Hugging Face itself included) is used as named, and a machine without git-lfs (`make run`
as an ordinary user, who cannot install it) runs everything but the demo, saying so in one line."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.system import ROOT, free_port, wait_for


@pytest.fixture
def command(settings: Any, tmp_path: Path) -> Any:
    """The run command with its output kept, its state in tmp_path, the demo port free."""
    from llmgw_site.management.commands.llmgw_run import Command

    settings.VAR_DIR = tmp_path / "var"
    settings.VAR_DIR.mkdir()
    settings.LLMGW_REGISTRY_ENDPOINT = ""
    settings.LLMGW_DEMO_REGISTRY_PORT = free_port()
    run = Command(stdout=io.StringIO(), stderr=io.StringIO())
    yield run
    from catalog.config import current_config

    current_config.cache_clear()


def said(stream: Any) -> str:
    """What the command wrote to one of its streams (an OutputWrapper around a StringIO)."""
    return str(stream._out.getvalue())


def nothing_started(settings: Any) -> bool:
    """No demo registry: nothing answers on its port and no repository was made."""
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{settings.LLMGW_DEMO_REGISTRY_PORT}/", timeout=2)
    return not (settings.VAR_DIR / "demo-registry").exists()


@pytest.fixture
def no_git_lfs(tmp_path: Path, monkeypatch: Any) -> Path:
    """A PATH with git on it and no git-lfs, as on a fresh Debian."""
    folder = tmp_path / "bin"
    folder.mkdir()
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    (folder / "git").symlink_to(git)
    monkeypatch.setenv("PATH", str(folder))
    return folder


def test_hugging_face_named_in_server_yaml_leaves_the_demo_out(
    command: Any, server_yaml: Any, settings: Any
) -> None:
    path = server_yaml({"registry": {"endpoint": "https://huggingface.co"}})
    assert command._demo_registry() is None
    assert said(command.stdout) == (
        f"  Registry:          https://huggingface.co (registry.endpoint in {path}); "
        "no demo registry or demo model\n"
    )
    assert said(command.stderr) == ""
    assert nothing_started(settings)
    # The named registry stays the one in force for this process and those it starts.
    from catalog.config import current_config

    assert current_config().registry_endpoint == "https://huggingface.co"
    assert "LLMGW_REGISTRY_ENDPOINT" not in os.environ


def test_a_registry_named_in_the_environment_leaves_the_demo_out(
    command: Any, server_yaml: Any, settings: Any
) -> None:
    server_yaml({})
    settings.LLMGW_REGISTRY_ENDPOINT = "https://hub.example.org"
    assert command._demo_registry() is None
    assert said(command.stdout) == (
        "  Registry:          https://hub.example.org (LLMGW_REGISTRY_ENDPOINT); "
        "no demo registry or demo model\n"
    )
    assert nothing_started(settings)


def test_without_git_lfs_the_demo_is_left_out_in_one_line(
    command: Any, server_yaml: Any, settings: Any, no_git_lfs: Path
) -> None:
    server_yaml({})  # no registry named: the demo would stand in
    assert command._demo_registry() is None
    lines = said(command.stderr).splitlines()
    assert lines == [
        "  Demo registry:     left out, and the demo model with it: git-lfs is not installed "
        "(apt-get install git-lfs). Install it and run again, or serve a model of your own: "
        "llmgw ctl model serve ORG/NAME --file '*Q4_K_M.gguf'"
    ]
    assert said(command.stdout) == ""
    assert nothing_started(settings)


def test_the_run_command_goes_on_without_git_lfs(tmp_path: Path, no_git_lfs: Path) -> None:
    """`manage.py llmgw_run` (what `make run` starts) on a machine without git-lfs: the web, the
    gateway, the worker and beat start and answer; only the demo is missing, said once."""
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "LLMGW", "PYTEST"))},
        "PATH": str(no_git_lfs),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "LLMGW_CONFIG": str(tmp_path / "server.yaml"),
        "LLMGW_SECRET_KEY": "test-secret-key-for-process-tests",
        "LLMGW_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "LLMGW_DEMO_REGISTRY_PORT": str(free_port()),
    }
    out = tmp_path / "run.out"
    with out.open("wb") as sink:
        run = subprocess.Popen(
            [sys.executable, "manage.py", "llmgw_run", "--no-node"],
            env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:

        def answers() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/login/", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        wait_for(answers, timeout=180, what="the run command's web behind its gateway")
        wait_for(lambda: "llmgw is running at" in out.read_text(), what="the banner")
        text = out.read_text()
        assert text.count("Demo registry:     left out") == 1, text
        assert "git-lfs is not installed" in text
        assert "Demo model:" not in text
        for name in ("gateway", "web", "worker", "beat"):
            assert re.search(rf"^started {name} \(pid \d+\)$", text, re.M), text
        assert "llmgw is running at" in text
    finally:
        run.send_signal(signal.SIGINT)
        run.wait(timeout=90)
    assert not (tmp_path / "var" / "demo-registry").exists()

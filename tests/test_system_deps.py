"""scripts/system-deps, which `make run` and `make test` call first: without root it installs
nothing, says the exact apt-get command that would, and exits 0 so that `make run` goes on
(without the demo). The root path (apt-get itself) is left to CI, which runs as root."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "system-deps"
ABSENT = "llmgw-test-absent-package"  # no such command, so it counts as missing
ADVICE = [
    f"note: {ABSENT} not installed, and installing needs root. Run:",
    f"  sudo apt-get update && sudo apt-get install -y {ABSENT}",
    "then run this again; until then the demo (make run) is left out and the tests that need "
    "them skip.",
]


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv,
        env={**os.environ, **(env or {})},
        cwd="/",  # a folder every user may enter
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_nothing_missing_says_nothing() -> None:
    result = run([str(SCRIPT), "bash", "sh"])
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="apt-get is not on this machine")
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs the script as nobody, which needs root and setpriv",
)
def test_as_an_ordinary_user_it_says_what_to_install_and_succeeds() -> None:
    # As `nobody`, which has no sudo: the script is read from stdin, as nobody may not be able
    # to read the checkout.
    result = subprocess.run(
        [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "bash",
            "-s",
            "--",
            "bash",
            ABSENT,
        ],
        input=SCRIPT.read_text(),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ADVICE
    assert result.stderr == ""


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="apt-get is not on this machine")
def test_the_ordinary_user_path_can_be_asked_for_by_root() -> None:
    result = run([str(SCRIPT), ABSENT], env={"LLMGW_SYSTEM_DEPS_AS_USER": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ADVICE

"""scripts/system-deps, which `make run` and `make test` call first: without root it installs
nothing, says the exact apt-get command that would, and exits 0 so that `make run` goes on
(without the demo). The root path (apt-get itself) is left to CI, which runs as root. `clis`
installs the coding CLIs with npm into a cache folder, once; here with a stand-in npm."""

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


# -- clis: the coding CLIs, from npm into a cache folder ------------------------------------------

FAKE_NPM = """#!/bin/sh
# npm install --prefix DIR ... PACKAGE@VERSION...: each CLI answers --version with its version.
echo "$@" >> "$NPM_CALLS"
[ -n "${NPM_FAILS:-}" ] && { echo "npm error code E404"; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift ;;
    @openai/codex@*) codex=${1##*@} ;;
    @anthropic-ai/claude-code@*) claude=${1##*@} ;;
  esac
  shift
done
mkdir -p "$prefix/node_modules/.bin" "$prefix/node_modules/@anthropic-ai/claude-code"
printf '#!/bin/sh\\necho "codex-cli %s"\\n' "$codex" > "$prefix/node_modules/.bin/codex"
printf '#!/bin/sh\\necho "%s (Claude Code)"\\n' "$claude" > "$prefix/node_modules/.bin/claude"
chmod +x "$prefix/node_modules/.bin/codex" "$prefix/node_modules/.bin/claude"
"""


def fake_npm(folder: Path) -> dict[str, str]:
    """A PATH whose npm is FAKE_NPM, and where it writes down how it was called."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM)
    (bin_dir / "npm").chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "NPM_CALLS": str(folder / "npm-calls"),
        "XDG_CACHE_HOME": str(folder / "cache"),
    }


def test_clis_are_installed_once_where_the_tests_find_them(tmp_path: Path) -> None:
    from tests.support.clis import find_cli, pinned_versions

    env = fake_npm(tmp_path)
    assert find_cli("codex", env) is None

    first = run([str(SCRIPT), "clis"], env)
    versions = pinned_versions()
    codex, claude = versions["CODEX_VERSION"], versions["CLAUDE_CODE_VERSION"]
    folder = tmp_path / "cache" / "llmgw" / "clis" / f"codex-{codex}-claude-code-{claude}"
    assert (first.returncode, first.stderr) == (0, "")
    assert first.stdout.splitlines() == [
        f"installing @openai/codex@{codex} @anthropic-ai/claude-code@{claude} into {folder}"
    ]
    assert find_cli("codex", env) == folder / "node_modules" / ".bin" / "codex"
    assert find_cli("claude", env) == folder / "node_modules" / ".bin" / "claude"
    assert [p.name for p in (tmp_path / "cache" / "llmgw" / "clis").iterdir()] == [
        folder.name
    ]  # no partial left

    again = run([str(SCRIPT), "clis"], env)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    assert len((tmp_path / "npm-calls").read_text().splitlines()) == 1


def test_a_failed_clis_install_says_so_leaves_nothing_and_succeeds(tmp_path: Path) -> None:
    from tests.support.clis import find_cli

    env = {**fake_npm(tmp_path), "NPM_FAILS": "1"}
    result = run([str(SCRIPT), "clis"], env)
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    assert lines[1].startswith("note: npm could not install @openai/codex@"), lines
    assert "  npm error code E404" in lines
    assert lines[-1] == (
        "run this again once the registry can be reached; until then the coding CLI tests "
        "(tests/gateway/test_coding_clis.py) skip."
    )
    assert not (tmp_path / "cache" / "llmgw" / "clis").exists() or not any(
        (tmp_path / "cache" / "llmgw" / "clis").iterdir()
    )
    assert find_cli("codex", env) is None

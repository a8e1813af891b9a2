"""Two operator's texts that fell behind the code (issue 44, item 9's brief): the web's systemd
unit starts gunicorn as the run command does, and docs/availability.md no longer says that two
first starts collide. (Beside tests/test_docs.py in spirit; kept here as the brief that asked for
them allowed tests under tests/console only.)"""

from __future__ import annotations

import configparser
import importlib
import re
from pathlib import Path

from llmgw_site.management.commands.llmgw_run import web_command

ROOT = Path(__file__).resolve().parents[2]
WEB_UNIT = ROOT / "contrib" / "systemd" / "llmgw-web.service"
# What a deployment chooses for itself: the address, and how many workers for how long.
CHOSEN_PER_DEPLOYMENT = {"--bind", "--workers", "--threads", "--timeout"}


def options(argv: list[str]) -> dict[str, str]:
    """`--name value` and `--name=value` alike, by name."""
    found: dict[str, str] = {}
    words = iter(argv)
    for word in words:
        if not word.startswith("--"):
            continue
        name, equals, value = word.partition("=")
        found[name] = value if equals else next(words, "")
    return found


def unit_argv() -> list[str]:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(WEB_UNIT.read_text())
    return parser["Service"]["ExecStart"].split()


def test_the_web_unit_passes_gunicorn_what_the_run_command_does() -> None:
    ours = options(web_command(Path("/opt/llmgw/.venv/bin"), "127.0.0.1:8001", timeout=300))
    units = options(unit_argv())
    assert ours["--logger-class"] == "llmgw_site.gunicornlog.Logger"
    for name, value in ours.items():
        assert name in units, f"the web unit lacks {name}, which the run command passes"
        if name not in CHOSEN_PER_DEPLOYMENT:
            assert units[name] == value, name
    module, _, attribute = units["--logger-class"].rpartition(".")
    assert hasattr(importlib.import_module(module), attribute)


def test_availability_says_first_starts_take_turns() -> None:
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "availability.md").read_text())
    assert "collide" not in text
    assert "the machines may start at the same moment" in text
    assert "`llmgw_site.startlock`" in text
    assert (ROOT / "llmgw_site" / "startlock.py").exists()

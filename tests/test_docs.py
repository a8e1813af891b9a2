"""The documentation is checked against what it describes, so that it cannot drift:

- docs/configuration.md names every environment variable the code reads, names none the code
  does not know, gives the code's default for each number, and lists every server.yaml key;
- the systemd units in contrib/systemd parse (systemd-analyze verify, where it is installed)
  and start commands that exist;
- every relative link in README.md and docs/ leads to a file, and to a heading there;
- the README stays a short guide;
- the shell and Python blocks marked `<!-- runnable -->` run, as written, against a started
  instance (the run command with its demo registry, node and model), so that a command the
  quick start gives that stops working fails the suite.
"""

from __future__ import annotations

import configparser
import getpass
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.docs import (
    ROOT,
    anchors,
    documented_names,
    links,
    read_names,
    runnable_blocks,
    table_rows,
)

DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
UNITS = ROOT / "contrib" / "systemd"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


# -- configuration.md against the code ---------------------------------------------------------


def test_every_variable_the_code_reads_is_documented() -> None:
    read = read_names()
    assert "LLMGW_SECRET_KEY" in read and "DATABASE_URL" in read  # the scan finds reads
    missing = sorted(set(read) - documented_names(CONFIGURATION.read_text()))
    assert not missing, (
        f"read by the code but not in docs/configuration.md: {missing} "
        f"(where: {[read[name] for name in missing]})"
    )


def test_every_documented_variable_exists_in_the_code() -> None:
    everywhere = read_names(everywhere=True)
    unknown = sorted(documented_names(CONFIGURATION.read_text(), ours=True) - set(everywhere))
    assert not unknown, f"in docs/configuration.md but read nowhere: {unknown}"


# A number default as the code gives it: env_int("NAME", 15 ...) in the settings, or
# _number("NAME", 32 * 1024 ...) in the gateway's.
NUMBER_DEFAULT = re.compile(
    r"(?:env_int|_number)\(\s*\"(LLMGW_[A-Z0-9_]+)\",\s*([0-9][0-9 *]*)[,)]"
)


def test_documented_number_defaults_are_the_codes() -> None:
    code: dict[str, int] = {}
    for path in (ROOT / "llmgw_site" / "settings.py", ROOT / "gateway" / "conf.py"):
        for name, expression in NUMBER_DEFAULT.findall(path.read_text()):
            factors = [int(part) for part in expression.split("*")]
            value = 1
            for factor in factors:
                value *= factor
            code[name] = value
    assert len(code) > 20
    documented: dict[str, str] = {}
    for cells in table_rows(CONFIGURATION.read_text()):
        if len(cells) < 3:
            continue
        names = re.findall(r"`(LLMGW_[A-Z0-9_]+)`", cells[0])
        defaults = [part.strip() for part in cells[2].split(",")]
        if len(names) > 1 and len(defaults) == len(names):
            documented.update(zip(names, defaults, strict=True))
        elif len(names) == 1:
            documented[names[0]] = cells[2].strip()
    wrong = {
        name: (documented.get(name), value)
        for name, value in code.items()
        if not re.match(rf"`?{value}\b", documented.get(name, ""))
    }
    assert not wrong, f"documented default differs from the code's (documented, code): {wrong}"


def test_every_server_yaml_key_is_documented_with_its_default() -> None:
    from catalog.config import _ServerFile
    from core.durations import format_duration
    from core.serializers import DurationField

    text = CONFIGURATION.read_text()
    rows = {
        match.group(1): cells
        for cells in table_rows(text)
        if (match := re.fullmatch(r"`([a-z_]+(?:\.[a-z_]+)?)`", cells[0].strip()))
    }
    keys = set()
    for section, field in _ServerFile().fields.items():
        children = getattr(field, "fields", None)
        if children is None:
            keys.add(section)
            continue
        for key, child in children.items():
            name = f"{section}.{key}"
            keys.add(name)
            assert name in rows, f"server.yaml's {name} is not in docs/configuration.md"
            if isinstance(child, DurationField):
                assert isinstance(child.default, int), name
                default = f"`{format_duration(child.default)}`"
                assert rows[name][2].strip() == default, (name, rows[name][2], default)
    assert "models" in rows
    assert set(rows) == keys, f"documented keys server.yaml does not have: {set(rows) - keys}"


# -- systemd units -------------------------------------------------------------------------------


def units() -> list[Path]:
    found = sorted(UNITS.glob("*.service"))
    assert {path.name for path in found} >= {
        "llmgw-web.service",
        "llmgw-gateway.service",
        "llmgw-worker.service",
        "llmgw-beat.service",
        "llmgw-node.service",
    }
    return found


# Arguments that name Python modules (and an attribute): each must import where the unit runs.
DOTTED = re.compile(r"^[a-z_]+(?:\.[a-z_]+)+(?::[A-Za-z_]+)?$")


@pytest.mark.parametrize("unit", units(), ids=lambda path: path.name)
def test_a_unit_has_its_sections_and_starts_a_real_command(unit: Path) -> None:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(unit.read_text())
    assert parser.sections() == ["Unit", "Service", "Install"]
    service = parser["Service"]
    assert service["Restart"] == "on-failure"
    assert service["User"] == "llmgw"
    argv = service["ExecStart"].split()
    venv_bin = Path(sys.executable).parent
    assert argv[0].startswith("/opt/llmgw/.venv/bin/"), argv[0]
    assert (venv_bin / Path(argv[0]).name).exists(), f"{argv[0]} is no command make setup installs"
    for word in argv[1:]:
        if DOTTED.match(word):
            module, _, attribute = word.partition(":")
            assert importlib.util.find_spec(module) is not None, f"{word}: no module {module}"
            if attribute:
                assert hasattr(importlib.import_module(module), attribute), word
    if Path(argv[0]).name == "llmgw":
        assert argv[1] == "node"
        help_text = subprocess.run(
            [sys.executable, "-m", "llmgw", "node", "--help"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ).stdout
        for option in (word for word in argv[2:] if word.startswith("--")):
            assert option in help_text, f"llmgw node has no option {option}"
    if Path(argv[0]).name == "celery":
        assert argv[1:3] == ["-A", "llmgw_site"]
        assert "-B" not in argv  # beat runs as a unit of its own, exactly once


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is absent")
def test_the_units_verify(tmp_path: Path) -> None:
    """systemd's own check, with the paths pointed at this checkout and its venv and the user at
    whoever runs the test (the units name /opt/llmgw and a llmgw user that are not here)."""
    venv_bin = Path(sys.executable).parent
    user = getpass.getuser()
    for unit in units():
        text = unit.read_text()
        text = text.replace("/opt/llmgw/.venv/bin/", f"{venv_bin}/").replace(
            "/opt/llmgw", str(ROOT)
        )
        text = re.sub(r"(?m)^(User|Group)=llmgw$", rf"\1={user}", text)
        text = text.replace("EnvironmentFile=/", "EnvironmentFile=-/")
        (tmp_path / unit.name).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.glob("*.service"))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_the_env_example_names_only_documented_variables() -> None:
    names = set(re.findall(r"(?m)^([A-Z][A-Z0-9_]+)=", (UNITS / "llmgw.env.example").read_text()))
    assert "LLMGW_SECRET_KEY" in names
    assert names <= documented_names(CONFIGURATION.read_text()) | {"DATABASE_URL", "REDIS_URL"}


# -- links and length ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page: Path) -> None:
    broken = []
    for target in links(page.read_text()):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.name}")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = set(links((ROOT / "README.md").read_text()))
    linked = {target.partition("#")[0] for target in readme}
    unlinked = [p.name for p in DOCS.glob("*.md") if f"docs/{p.name}" not in linked]
    assert not unlinked, unlinked


def test_the_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, len(lines)


# -- the runnable blocks, against a started instance --------------------------------------------


def test_the_readme_has_runnable_blocks() -> None:
    blocks = runnable_blocks((ROOT / "README.md").read_text())
    assert [language for language, _ in blocks] == ["sh", "python"]


def _engine_missing() -> str | None:
    from llmgw.engine import find_engine
    from tests.support.registry import available

    if find_engine() is None:
        return "llama-server is not built (make setup builds it)"
    return available()


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.support.first_run import FirstRun

    why = _engine_missing()
    if why:
        pytest.skip(why)
    run = FirstRun(tmp_path_factory.mktemp("docs-run"))
    try:
        run.start()
        # "llmgw is running" is said once the public port answers through to the web: the
        # newcomer's first command, typed on reading it, is answered.
        assert run.api("GET", "models") is not None
        yield run
    except BaseException:
        print(run.log()[-6000:])
        raise
    finally:
        run.stop()


@pytest.mark.engine
@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if runnable_blocks(p.read_text())],
    ids=lambda path: str(path.relative_to(ROOT)),
)
def test_the_runnable_blocks_run(page: Path, started: object, tmp_path: Path) -> None:
    """Every block marked runnable on the page, in order, in one shell (as a reader pastes them
    into one terminal), from a folder whose .venv is this one, after the `export` line the run
    command printed; the run's own address replaces http://127.0.0.1:8000."""
    url, token = started.url, started.token  # type: ignore[attr-defined]
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    script = ["set -e"]
    for language, body in runnable_blocks(page.read_text()):
        body = body.replace("http://127.0.0.1:8000", url)
        if language == "sh":
            script.append(body)
        else:
            script.append(f".venv/bin/python - <<'RUNNABLE_PYTHON'\n{body}\nRUNNABLE_PYTHON")
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LLMGW_URL": url,
        "LLMGW_TOKEN": token,
    }
    result = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    if page.name == "README.md":
        # curl's whole answer on a line, then the openai snippet's printed answer: random
        # text from the tiny model, but text (16 tokens asked for).
        answer_line, _, printed = result.stdout.partition("\n")
        assert '"object":"chat.completion"' in answer_line.replace(" ", ""), result.stdout
        assert printed.rstrip("\n") != "", result.stdout


# -- backup.md, followed --------------------------------------------------------------------------


@pytest.mark.engine
def test_a_backup_restored_into_a_fresh_install_serves(tmp_path: Path) -> None:
    """docs/backup.md: an online SQLite backup, the secret key, the token files and the mirror,
    taken while the install serves, restored into an empty folder: the restored install knows
    the old API token and gateway key and serves the model from the restored mirror."""
    why = _engine_missing()
    if why:
        pytest.skip(why)
    import requests

    from llmgw import demo
    from tests.support.first_run import FirstRun
    from tests.support.restore import RestoredRun, backup, restore
    from tests.support.system import wait_for

    def ready(api: Any) -> bool:
        return bool(api("GET", f"models/{demo.DEMO_MODEL}")["ready"] >= 1)

    def chat(url: str, key: str) -> requests.Response:
        return requests.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": demo.DEMO_MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
            },
            timeout=60,
        )

    first = FirstRun(tmp_path / "first")
    (tmp_path / "first").mkdir()
    try:
        first.start()
        wait_for(lambda: ready(first.api), what="the demo model ready", timeout=240)
        key = first.api("POST", "keys", json={"name": "kept"})["key"]
        assert chat(first.url, key).status_code == 200
        backup(first.folder, tmp_path / "saved")
    finally:
        first.stop()

    restore(tmp_path / "saved", tmp_path / "second")
    second = RestoredRun(tmp_path / "second", first)
    try:
        second.start()
        assert not second.printed_a_new_token()  # it found the restored admin
        # The database was saved with a replica ready on an engine that stopped with the first
        # run: until the node's heartbeats say otherwise and it starts the replica again from
        # the restored mirror, requests to it fail (502). Then it serves.
        started_at = time.monotonic()
        wait_for(
            lambda: chat(second.url, key).status_code == 200,
            what="the restored install answering",
            timeout=240,
            interval=1,
        )
        print(
            f"the restored install answered {time.monotonic() - started_at:.1f} s after it started"
        )
        answer = chat(second.url, key)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        audit = second.api("GET", f"audit?model={demo.DEMO_MODEL}")
        assert audit, "the audit came back with the database"
    except BaseException:
        print(second.log()[-6000:])
        raise
    finally:
        second.stop()

"""What a newcomer reads about the console (README, `llmgw demo publish`, a form's help) names
what is there and says what the code does."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from llmgw import demo
from llmgw.engine import lora_request
from tests.console.pages import text_of
from tests.console.views.test_model_registry import from_the_registry

pytestmark = [pytest.mark.django_db]

README = Path(__file__).resolve().parents[2] / "README.md"
CHECK_BUTTON = "Check for updates now"


def buttons_of(html: str) -> list[str]:
    return [
        re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", label)).strip()
        for label in re.findall(r"<button[^>]*>(.*?)</button>", html, re.S)
    ]


def five_steps() -> str:
    text = README.read_text()
    start = text.index("## An update in five steps")
    return re.sub(r"\s+", " ", text[start : text.index("\n## ", start + 1)])


def test_it_offers_the_check_on_the_models_page_and_not_on_the_list(
    client_for: Any, running: Any
) -> None:
    from_the_registry(update=False)
    client = client_for("alice")
    assert CHECK_BUTTON in buttons_of(client.get("/models/tiny-chat/").content.decode())
    listed = buttons_of(client.get("/").content.decode())
    assert not [label for label in listed if label.lower().startswith("check")]


def test_the_readme_names_the_check_button_where_it_is() -> None:
    steps = five_steps()
    assert "Check now" not in steps
    assert f"press **{CHECK_BUTTON}**" in steps
    step = steps[steps.index("3. ") : steps.index("4. ")]
    assert "Open `demo-tiny-chat` on the Models page" in step


def test_demo_publish_names_the_check_button_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="llmgw")
    demo.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "publish", "--help"])
    described = " ".join(capsys.readouterr().out.split())
    assert "Check now" not in described
    assert f"{CHECK_BUTTON} on the model's page in the console" in described

    (tmp_path / "mirrors").mkdir()
    monkeypatch.setattr(demo, "unavailable", lambda: None)
    monkeypatch.setattr(demo, "hub", lambda folder: None)
    monkeypatch.setattr(demo, "publish", lambda hub: ("061fddf" + "0" * 33, 7))
    assert demo.run(argparse.Namespace(folder=tmp_path)) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "Check now" not in printed
    assert f"or {CHECK_BUTTON} on demo-tiny-chat's page in the console;" in printed


def test_the_adapter_forms_help_says_the_catalogs_scale_applies(
    client_for: Any, running: Any
) -> None:
    text = text_of(client_for("alice").get("/models/tiny-chat/"))
    assert "applies adapters at 1.0" not in text
    assert (
        "1 when empty; from 0 to 10. A request for this adapter gets it at this scale (the "
        "gateway asks the engine for it per request), and the base model's requests at 0."
    ) in text
    # What the help says, as the gateway asks the engine for it.
    adapters = [{"name": "tiny-sql", "scale": 0.8}, {"name": "tiny-code", "scale": 0.5}]
    assert lora_request(adapters, "tiny-sql") == [
        {"id": 0, "scale": 0.8},
        {"id": 1, "scale": 0.0},
    ]
    assert lora_request(adapters, "tiny-chat") == [
        {"id": 0, "scale": 0.0},
        {"id": 1, "scale": 0.0},
    ]

"""`llmgw ctl model show NAME`: the definition as YAML, and for a model that follows the registry,
where its weights come from, in comments that keep the YAML one `model add -f` takes back."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from catalog.models import Model
from llmgw.client import Client
from tests.factories import definition
from tests.llmgw.ctl.test_commands import ctl  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db(transaction=True)

COMMIT = "0123abc" + "9" * 33
ORIGIN = {
    "repo": "acme/tiny-chat",
    "branch": "release",
    "commit": COMMIT,
    "files": [{"path": "tiny-chat.gguf", "sha256": "f" * 64, "size": 1234}],
}


@pytest.fixture
def chat(users: dict[str, Any]) -> Model:
    from catalog.definitions import clean_definition
    from catalog.services import model_add
    from core.actor import Actor

    return model_add(
        actor=Actor.for_user(users["alice"], "api"),
        definition=clean_definition(definition("tiny-chat")),
        source_check=False,
    )


def test_it_prints_where_the_weights_of_a_registry_model_come_from(ctl: Any, chat: Model) -> None:  # noqa: F811
    Model.objects.filter(pk=chat.pk).update(origin=ORIGIN)
    code, out, err = ctl("bob", "model", "show", "tiny-chat")
    assert code == 0, err
    assert out.splitlines()[-5:] == [
        "# Its weights follow the registry:",
        "#   repository acme/tiny-chat",
        "#   branch     release",
        f"#   commit     {COMMIT}",
        "#   file       tiny-chat.gguf",
    ]
    # Under the definition, which still reads back as it was.
    assert yaml.safe_load(out) == yaml.safe_load(
        yaml.safe_dump(Model.objects.get(pk=chat.pk).definition())
    )


def test_it_prints_no_origin_for_a_model_outside_the_registry(ctl: Any, chat: Model) -> None:  # noqa: F811
    code, out, _ = ctl("bob", "model", "show", "tiny-chat")
    assert code == 0
    assert "registry" not in out
    assert not out.splitlines()[-1].startswith("#")


def test_its_json_is_the_apis_answer_unchanged(
    ctl: Any,  # noqa: F811
    chat: Model,
    live_server: Any,
    tokens: dict[str, str],
) -> None:
    Model.objects.filter(pk=chat.pk).update(origin=ORIGIN)
    _, shown, _ = ctl("bob", "model", "show", "tiny-chat", "--json")
    answer = Client(live_server.url, tokens["bob"]).get("models/tiny-chat")
    assert json.loads(shown) == answer
    assert answer["origin"] == ORIGIN

"""The add page: a model from pasted YAML, its problems shown beside their lines."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from catalog.models import AuditEntry, Model
from tests.console.pages import HTMX, text_of
from tests.factories import definition

pytestmark = [pytest.mark.django_db]


def test_the_add_page_offers_an_example_and_the_skip_checkbox(client_for: Any, users: Any) -> None:
    html = client_for("alice").get("/add/").content.decode()
    assert "name: my-model" in html
    assert 'name="skip_source_check"' in html


def test_adding_from_yaml_makes_you_the_owner(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(definition("pasted"), sort_keys=False)
    response = client_for("bob").post("/add/model", {"definition": text, "skip_source_check": "on"})
    assert response.status_code == 302
    assert response["Location"] == "/models/pasted/"
    model = Model.objects.get(name="pasted")
    assert model.owner.username == "bob"
    entry = AuditEntry.objects.get(action="add")
    assert (entry.actor_name, entry.door) == ("bob", "console")
    htmx = client_for("bob").post(
        "/add/model",
        {"definition": text.replace("pasted", "pasted-2"), "skip_source_check": "on"},
        headers=HTMX,
    )
    assert htmx["HX-Redirect"] == "/models/pasted-2/"


def test_problems_are_shown_next_to_their_lines(client_for: Any, users: Any) -> None:
    text = (
        "name: bad-one\n"
        "source: http://127.0.0.1:8000/mirror/a/b/c/x.gguf\n"
        "min_replicas: -1\n"
        "profiles:\n"
        "  - {name: cpu, memory_gb: 1, cores: 1}\n"
        "colour: blue\n"
    )
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}, headers=HTMX
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert html.lstrip().startswith('<form id="add-form"')
    assert "The definition was refused, nothing was changed:" in text_of(response)
    line3 = html[html.index('id="line-3"') : html.index('id="line-4"')]
    assert "min_replicas: -1" in line3 and "must not be negative" in line3
    line6 = html[html.index('id="line-6"') :]
    assert "unknown field; known fields:" in line6[: line6.index("</li>")]
    assert 'id="line-5" data-line="5">' in html  # a line without a problem is not marked
    assert not Model.objects.filter(name="bad-one").exists()


def test_whole_catalog_problems_find_their_line_too(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(definition("lonely", fallbacks=["ghost"]), sort_keys=False)
    number = text.splitlines().index("- ghost") + 1
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}, headers=HTMX
    )
    assert response.status_code == 400
    html = response.content.decode()
    line = html[html.index(f'id="line-{number}"') :]
    assert "there is no model named 'ghost' to fall back to; add it first" in line[
        : line.index("</li>")
    ].replace("&#x27;", "'")


def test_yaml_that_cannot_be_read_points_at_its_line(client_for: Any, users: Any) -> None:
    text = "name: x\nsource: [unclosed\nprofiles: []\n"
    response = client_for("alice").post("/add/model", {"definition": text})
    assert response.status_code == 400
    assert "The definition is not valid YAML: the YAML could not be read on line" in text_of(
        response
    )
    assert 'class="has-problem"' in response.content.decode()


def test_the_source_is_checked_unless_skipped(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(
        definition("far", source="http://example.invalid/far.gguf"), sort_keys=False
    )
    response = client_for("alice").post("/add/model", {"definition": text})
    assert response.status_code == 400
    assert (
        "The control plane may not fetch http://example.invalid/far.gguf: example.invalid:80 is not in"
        in text_of(response)
    )
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}
    )
    assert response.status_code == 302


def test_a_taken_name_is_a_conflict(client_for: Any, running: Any) -> None:
    text = yaml.safe_dump(definition("tiny-chat"), sort_keys=False)
    response = client_for("bob").post("/add/model", {"definition": text, "skip_source_check": "on"})
    assert response.status_code == 409
    assert "A model named tiny-chat already exists (added at runtime, owned by alice)." in text_of(
        response
    )


def test_only_staff_may_add_a_model_for_someone_else(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(definition("gift", owner="bob"), sort_keys=False)
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}
    )
    assert response.status_code == 403
    assert "only staff may add one owned by bob" in text_of(response)
    response = client_for("staff").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}
    )
    assert response.status_code == 302
    assert Model.objects.get(name="gift").owner.username == "bob"

"""Hostile YAML pasted into the console's Add page and the admin's add form: refused, nothing written."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from django.test import Client

from catalog.models import AuditEntry, Model
from tests.console.pages import HTMX, text_of
from tests.factories import definition

pytestmark = pytest.mark.django_db

GOOD = yaml.safe_dump(definition("pasted"), sort_keys=False)
BOMB = (
    'a0: &a0 "lol"\n'
    + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))
    + "name: *a9\n"
)

HOSTILE = {
    "alias-bomb": (BOMB, 6, "through its anchors and aliases it expands to more than 100,000"),
    "duplicate-key": (
        GOOD + "name: other\n",
        len(GOOD.splitlines()) + 1,
        "the key 'name' is given twice in one mapping (lines 1 and",
    ),
    "huge-integer": (
        GOOD.replace("min_replicas: 1", "min_replicas: " + "9" * 5000),
        GOOD.splitlines().index("min_replicas: 1") + 1,
        "a number with 5000 digits is larger than any field takes",
    ),
    "deep-nesting": (
        GOOD + "adapters: " + "[" * 10_000 + "]" * 10_000 + "\n",
        len(GOOD.splitlines()) + 1,
        "it is nested more than 32 levels deep",
    ),
}


@pytest.fixture
def nothing_written() -> Any:
    yield
    assert not Model.objects.exists()
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_add_page_refuses_hostile_yaml_at_its_line(
    client_for: Any, nothing_written: None, case: str
) -> None:
    text, line, message = HOSTILE[case]
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}, headers=HTMX
    )
    assert response.status_code == 400
    assert "The definition is not valid YAML: the YAML was refused on line" in text_of(response)
    html = response.content.decode().replace("&#x27;", "'")
    marked = html[html.index(f'id="line-{line}"') :]
    assert message in marked[: marked.index("</li>")]


@pytest.fixture
def admin_client(users: Any) -> Client:
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", password="root-pw-1"))
    return client


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_admin_refuses_hostile_yaml(
    admin_client: Client, nothing_written: None, case: str
) -> None:
    text, _line, message = HOSTILE[case]
    response = admin_client.post(
        "/admin/catalog/model/add/", {"definition_yaml": text, "skip_source_check": "on"}
    )
    assert response.status_code == 200
    assert message in text_of(response)

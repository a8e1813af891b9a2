"""The nodes page: capacity, reserved, free and replicas; cordon and uncordon."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.models import Node
from tests.console.pages import HTMX, text_of

pytestmark = [pytest.mark.django_db]


@pytest.mark.smoke
def test_the_nodes_page_shows_capacity_reserved_free_and_replicas(
    client_for: Any, running: Any
) -> None:
    response = client_for("carol").get("/nodes/")
    assert response.status_code == 200
    html = response.content.decode()
    text = text_of(response)
    assert "node-a" in text and "ready" in text
    assert "1 / 8 GB reserved · 7 free" in text
    assert "1 / 4 reserved · 3 free" in text
    assert 'style="width: 12%"' in html and 'style="width: 25%"' in html
    assert "tiny-chat" in text and "last heartbeat 0 minutes ago" in text
    assert "Cordon" not in text  # carol is not staff


def test_staff_cordon_and_uncordon_a_node(client_for: Any, running: Any) -> None:
    client = client_for("staff")
    assert "Cordon" in text_of(client.get("/nodes/"))
    response = client.post("/nodes/node-a/cordon", headers=HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith('<article class="card node" id="node-node-a"')
    assert "node-a is cordoned: it keeps its replicas, and nothing new is placed there." in html
    assert "Uncordon" in html
    assert Node.objects.get(name="node-a").cordoned
    response = client.post("/nodes/node-a/uncordon")
    assert response.status_code == 302
    assert not Node.objects.get(name="node-a").cordoned


def test_someone_not_staff_may_not_cordon(client_for: Any, running: Any) -> None:
    for headers in (HTMX, {}):
        response = client_for("alice").post("/nodes/node-a/cordon", headers=headers)
        assert response.status_code == 403
        assert "Only staff may cordon nodes; ask an administrator." in text_of(response)
    assert not Node.objects.get(name="node-a").cordoned


def test_an_unknown_node_is_told(client_for: Any, running: Any) -> None:
    response = client_for("staff").post("/nodes/nope/cordon")
    assert response.status_code == 404
    assert "There is no node named 'nope' (nodes: node-a)." in text_of(response)

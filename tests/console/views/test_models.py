"""The models page: each model with its replicas, the filters, the pages, the queries it takes."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from catalog.models import Model
from fleet.reconciler import reconcile_pass
from tests.console.pages import row_of, text_of

pytestmark = [pytest.mark.django_db]


def test_the_list_shows_each_model_with_where_its_replicas_run(
    client_for: Any, running: Any
) -> None:
    response = client_for("carol").get("/")
    assert response.status_code == 200
    html = response.content.decode()
    row = row_of(html, "tiny-chat")
    assert "alice" in row and "standard" in row
    assert "1/1" in row and "node-a" in row and "state-ready" in row
    other = row_of(html, "other-chat")
    assert "not running" in other and "bob" in other
    assert 'class="registry-col"' in row  # the place kept for the registry badge and buttons


def test_the_list_filters_by_owner_class_state_and_name(client_for: Any, running: Any) -> None:
    client = client_for("carol")

    def names(query: str) -> list[str]:
        return re.findall(r'data-model="([^"]+)"', client.get(f"/?{query}").content.decode())

    assert names("owner=bob") == ["other-chat"]
    assert names("class=standard") == ["other-chat", "tiny-chat"]
    assert names("class=critical") == []
    assert names("state=ready") == ["tiny-chat"]
    assert names("state=not-running") == ["other-chat"]
    assert names("state=degraded") == []
    assert names("q=TINY") == ["tiny-chat"]
    assert "No model matches these filters." in text_of(client.get("/?q=nothing"))


def test_on_demand_models_filter_as_opportunistic(client_for: Any, fleet: Any) -> None:
    fleet.add("lazy", min_replicas=0, max_replicas=1)
    fleet.add("pinned", min_replicas=0, max_replicas=1, **{"class": "critical"})
    html = client_for("alice").get("/?class=opportunistic").content.decode()
    assert re.findall(r'data-model="([^"]+)"', html) == ["lazy"]


def test_a_model_with_fewer_ready_than_wanted_is_degraded(client_for: Any, running: Any) -> None:
    from catalog.services import model_scale
    from core.actor import Actor

    alice = Model.objects.get(name="tiny-chat").owner
    model_scale(actor=Actor.for_user(alice, "api"), name="tiny-chat", min_replicas=3)
    html = client_for("alice").get("/?state=degraded").content.decode()
    assert re.findall(r'data-model="([^"]+)"', html) == ["tiny-chat"]
    assert "1/3" in html


def test_htmx_gets_only_the_table(client_for: Any, running: Any) -> None:
    response = client_for("alice").get("/?owner=alice", headers={"HX-Request": "true"})
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="models-table">')
    assert "<html" not in html
    assert "HX-Request" in response["Vary"]


def test_the_list_pages_through_models(client_for: Any, fleet: Any) -> None:
    for i in range(55):
        fleet.add(f"m-{i:02d}", min_replicas=0, max_replicas=0)
    client = client_for("alice")
    first = client.get("/").content.decode()
    assert len(re.findall(r'data-model="', first)) == 50
    assert "Page 1 of 2 · 55 in all" in text_of(client.get("/"))
    assert 'href="/?page=2"' in first and 'hx-get="/?page=2"' in first
    second = client.get("/?page=2").content.decode()
    assert re.findall(r'data-model="([^"]+)"', second) == [f"m-{i}" for i in range(50, 55)]
    filtered = client.get("/?q=m-&page=2").content.decode()
    assert 'href="/?q=m-&amp;page=1"' in filtered


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured.captured_queries)


def test_the_list_takes_the_same_number_of_queries_whatever_the_number_of_models(
    client_for: Any, fleet: Any
) -> None:
    fleet.node("node-a", memory_gb=1000, cores=1000)
    client = client_for("alice")
    fleet.add("m-000")
    reconcile_pass()
    fleet.beat("node-a")
    few = _queries(client, "/"), _queries(client, "/?state=ready&class=standard&q=m")
    for i in range(1, 40):
        fleet.add(f"m-{i:03d}", min_replicas=2)
    reconcile_pass()
    fleet.beat("node-a")
    many = _queries(client, "/"), _queries(client, "/?state=ready&class=standard&q=m")
    assert few == many

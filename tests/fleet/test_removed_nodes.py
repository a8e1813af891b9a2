"""A removed node's token (fleet.models.RemovedNode): its agent's heartbeats and renewals are
answered 410 with who removed it and when, at the web and through the gateway's renewal door,
while a token never known stays 401 and known nodes pay nothing for it (issue 44, item 7)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from fleet import renewals
from fleet.models import REMOVED_NODE_KEPT, Node, RemovedNode
from fleet.services import node_remove
from tests.support.fleet import Fleet

pytestmark = [pytest.mark.django_db]

DIGEST = "a" * 64
REPORT = {"capacity": {"memory_gb": 8, "cores": 4}, "replicas": [], "report_digest": DIGEST}
RENEWAL = {"generation": 0, "report_digest": DIGEST}


def client(token: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return api


def said_of(name: str, by: str) -> str:
    removal = RemovedNode.objects.get(name=name)
    return (
        f"This node ({name}) was removed by {by} at "
        f"{removal.removed_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC; the control "
        f"plane no longer takes its token. To run replicas on this machine again, add the node "
        f"again (`llmgw ctl node add {name}`) and start its agent with the new token."
    )


@pytest.mark.smoke
def test_a_removed_nodes_heartbeat_and_renewal_are_told_who_removed_it_and_when(
    fleet: Fleet, api: Any
) -> None:
    fleet.node("n1")
    agent = client(fleet.tokens["n1"])
    assert agent.post("/api/v1/node/heartbeat", REPORT, format="json").status_code == 200

    assert api("staff").delete("/api/v1/nodes/n1").status_code == 204

    said = said_of("n1", "staff")
    for path, body in (("heartbeat", REPORT), ("renew", RENEWAL)):
        response = agent.post(f"/api/v1/node/{path}", body, format="json")
        assert response.status_code == 410, (path, response.content)
        assert response.json() == {"detail": said, "code": "node_removed"}
    # A token never known is what it was: 401.
    stranger = client("llmgw-node-never-issued").post("/api/v1/node/renew", RENEWAL, format="json")
    assert stranger.status_code == 401
    assert "not a node token the control plane knows" in stranger.json()["detail"]


def test_a_node_added_again_under_the_same_name_works_and_its_old_agent_still_hears_it(
    fleet: Fleet, api: Any
) -> None:
    fleet.node("n1")
    old = client(fleet.tokens["n1"])
    node_remove(actor=fleet.staff, name="n1")
    token = api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json").json()["token"]

    again = client(token).post("/api/v1/node/heartbeat", REPORT, format="json")
    assert again.status_code == 200 and again.json()["node"] == "n1"
    assert client(token).post("/api/v1/node/renew", RENEWAL, format="json").json()["report"] == (
        "current"
    )
    assert old.post("/api/v1/node/renew", RENEWAL, format="json").status_code == 410
    # Removed again: its second token is remembered beside the first.
    node_remove(actor=fleet.staff, name="n1")
    assert client(token).post("/api/v1/node/renew", RENEWAL, format="json").status_code == 410
    assert RemovedNode.objects.filter(name="n1").count() == 2


def test_a_removal_is_remembered_a_month_then_forgotten_at_a_later_removal(fleet: Fleet) -> None:
    fleet.node("old")
    fleet.node("new")
    old = client(fleet.tokens["old"])
    node_remove(actor=fleet.staff, name="old")
    RemovedNode.objects.filter(name="old").update(
        removed_at=timezone.now() - REMOVED_NODE_KEPT - timedelta(minutes=1)
    )
    assert old.post("/api/v1/node/renew", RENEWAL, format="json").status_code == 410

    node_remove(actor=fleet.staff, name="new")

    assert list(RemovedNode.objects.values_list("name", flat=True)) == ["new"]
    assert old.post("/api/v1/node/renew", RENEWAL, format="json").status_code == 401


def test_a_known_nodes_heartbeat_and_renewal_never_read_the_removals(fleet: Fleet) -> None:
    fleet.node("n1")
    fleet.node("gone")
    node_remove(actor=fleet.staff, name="gone")
    agent = client(fleet.tokens["n1"])
    with CaptureQueriesContext(connection) as queries:
        assert agent.post("/api/v1/node/heartbeat", REPORT, format="json").status_code == 200
        assert agent.post("/api/v1/node/renew", RENEWAL, format="json").status_code == 200
    assert not [q["sql"] for q in queries.captured_queries if "fleet_removednode" in q["sql"]]


@pytest.mark.smoke
def test_the_gateways_renewal_door_hands_a_removed_nodes_renewal_to_the_web_which_says_410(
    fleet: Fleet, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway holds only nodes that exist (NodeTable reads fleet_node), so a removed node's
    renewal is not answered there: it reaches the web as it came, as a stranger's (outside the
    node gate), and the web's answer, 410, is what the node gets back through the gateway
    (gateway.webforward relays it; tests/fleet/test_fleet_e2e.py runs the whole path)."""
    from gateway import app
    from gateway.process import Gateway

    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600  # held in memory; nothing written here
    fleet.node("n1")
    fleet.node("gone")
    for name in ("n1", "gone"):
        client(fleet.tokens[name]).post("/api/v1/node/heartbeat", REPORT, format="json")
    node_remove(actor=fleet.staff, name="gone")
    application = app.Application()
    gateway = application.gateway = Gateway()
    table = gateway.renewals.table
    table.read()
    table._started = True  # no reading thread in this test
    assert {row.name for row in table.rows.values()} == {"n1"}
    monkeypatch.setattr(gateway.renewals.liveness, "renewed", lambda pk, at: None)
    forwarded: list[tuple[bytes, bool]] = []

    async def forward(
        web: Any, budget: Any, scope: Any, receive: Any, send: Any, *, node: bool = False
    ) -> None:
        forwarded.append(((await receive())["body"], node))

    monkeypatch.setattr(app, "forward", forward)
    answers: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        answers.append(message)

    def renew(token: str) -> None:
        async def receive() -> dict[str, Any]:
            return {
                "type": "http.request",
                "body": json.dumps(RENEWAL).encode(),
                "more_body": False,
            }

        headers = [(b"authorization", f"Bearer {token}".encode())]
        request = {"type": "http", "path": renewals.PATH, "method": "POST", "headers": headers}
        asyncio.run(application(request, receive, send))

    renew(fleet.tokens["n1"])
    assert answers[0]["status"] == 200 and forwarded == []  # answered by the gateway itself
    renew(fleet.tokens["gone"])
    assert forwarded == [(json.dumps(RENEWAL).encode(), False)]
    # What the web answers it, as it came.
    body, _ = forwarded[0]
    web = client(fleet.tokens["gone"]).post(renewals.PATH, body, content_type="application/json")
    assert web.status_code == 410
    assert web.json() == {"detail": said_of("gone", "staff"), "code": "node_removed"}
    assert Node.objects.filter(name="gone").count() == 0


def test_the_admin_lists_the_removals_without_the_tokens_digest(
    admin_client: Any, fleet: Fleet
) -> None:
    fleet.node("n1")
    digest = Node.objects.get(name="n1").token_hash
    node_remove(actor=fleet.staff, name="n1")
    removal = RemovedNode.objects.get()
    for path in (
        "/admin/fleet/removednode/?q=n1",
        f"/admin/fleet/removednode/{removal.pk}/change/",
    ):
        page = admin_client.get(path)
        assert page.status_code == 200, path
        assert "n1" in page.content.decode() and digest not in page.content.decode()

"""Which renewals the gateway answers itself (gateway.renewals.held_row) and its copy of the nodes
(NodeTable.read); the whole path through real processes is in tests/fleet/test_fleet_e2e.py."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from fleet.models import Node
from gateway import renewals
from gateway.renewals import NodeRow, NodeTable, held_row
from llmgw import bearer
from tests.support.fleet import Fleet

TOKEN = "llmgw-node-abc"
DIGEST = "d" * 64
NOW = timezone.now()


def rows(**changes: Any) -> dict[str, NodeRow]:
    row = {
        "pk": 7,
        "name": "n1",
        "generation": 3,
        "lost": False,
        "report_digest": DIGEST,
        "last_heartbeat": NOW - timedelta(seconds=2),
        **changes,
    }
    return {bearer.digest(TOKEN): NodeRow(**row)}


def body(**changes: Any) -> bytes:
    return json.dumps({"generation": 3, "report_digest": DIGEST, **changes}).encode()


def test_a_current_renewal_of_a_held_node_is_answered_here() -> None:
    row = held_row(rows(), f"Bearer {TOKEN}", body(), NOW, 30)
    assert row is not None and (row.pk, row.name, row.generation) == (7, "n1", 3)
    assert held_row(rows(), f"token {TOKEN}", body(), NOW, 30) is not None


@pytest.mark.parametrize(
    ("held", "authorization", "sent"),
    [
        (rows(), "Bearer another-token", body()),  # not held (or new): the web says 401 or knows
        (rows(), "", body()),
        (rows(), f"Basic {TOKEN}", body()),
        (rows(), f"Bearer {TOKEN}", body(generation=2)),  # an older generation: orders to send
        (rows(), f"Bearer {TOKEN}", body(generation=None)),
        (rows(), f"Bearer {TOKEN}", body(generation=True)),
        (rows(), f"Bearer {TOKEN}", body(report_digest="e" * 64)),  # another report
        (rows(), f"Bearer {TOKEN}", b"not json"),
        (rows(), f"Bearer {TOKEN}", b"[1, 2]"),
        (rows(), f"Bearer {TOKEN}", b"[" * 4096),  # deeper than the parser recurses
        (rows(lost=True), f"Bearer {TOKEN}", body()),
        (rows(report_digest=""), f"Bearer {TOKEN}", body(report_digest="")),
        (rows(last_heartbeat=None), f"Bearer {TOKEN}", body()),
        (rows(last_heartbeat=NOW - timedelta(seconds=31)), f"Bearer {TOKEN}", body()),
    ],
)
def test_anything_else_goes_to_the_web(held: Any, authorization: str, sent: bytes) -> None:
    assert held_row(held, authorization, sent, NOW, 30) is None


@pytest.mark.django_db
def test_the_copy_holds_each_node_by_its_tokens_digest(users: dict[str, Any]) -> None:
    Fleet(users["staff"], users["alice"]).node("n1")
    Node.objects.filter(name="n1").update(generation=5, report_digest=DIGEST)
    table = NodeTable()
    table.read()
    (row,) = table.rows.values()
    assert table.rows == {Node.objects.get().token_hash: row}
    assert (row.name, row.generation, row.report_digest, row.lost) == ("n1", 5, DIGEST, False)
    assert row.last_heartbeat is not None and row.last_heartbeat.tzinfo is not None
    assert abs(row.last_heartbeat - timezone.now()) < timedelta(minutes=1)
    assert table.ready.is_set() and table.lost_after == 30


def scope(token: str, method: str = "POST") -> dict[str, Any]:
    return {"method": method, "headers": [(b"authorization", f"Bearer {token}".encode())]}


@pytest.mark.parametrize(
    ("changes", "request_scope", "renewed"),
    [
        ({}, scope(TOKEN), True),
        ({}, scope("another-token"), False),
        ({}, scope(TOKEN, "GET"), False),
        ({"lost": True}, scope(TOKEN), False),  # a lost node comes back through its report
        ({"heard_ago": timedelta(minutes=5)}, scope(TOKEN), False),
        ({"last_heartbeat": None}, scope(TOKEN), False),
    ],
)
def test_a_whole_report_renews_its_node_before_it_goes_to_the_web(
    changes: dict[str, Any],
    request_scope: dict[str, Any],
    renewed: bool,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings.LLMGW_RENEWAL_FLUSH_SECONDS = 3600  # held in memory; nothing written here
    changes = dict(changes)
    ago = changes.pop("heard_ago", timedelta(seconds=2))
    held = rows(**{"last_heartbeat": timezone.now() - ago, **changes})
    table = NodeTable()
    table.rows, table.lost_after = held, 30.0
    table.ready.set()
    table._started = True  # no reading thread in this test
    monkeypatch.setattr(renewals, "table", table)
    taken: list[int] = []
    monkeypatch.setattr(renewals.liveness, "renewed", lambda pk, at: taken.append(pk))
    renewals.note_alive(request_scope)
    assert taken == ([7] if renewed else [])

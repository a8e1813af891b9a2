"""`llmgw ctl keys` / `key create` / `key revoke` against a running server: pytest-django's live
server behind the gateway's ASGI application, which serves /v1/ from memory, refreshed by its own
thread on the database's change notifications, and forwards the rest to the live server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from access.models import GatewayKey
from tests.gateway.conftest import GatewayServer
from tests.support.ctl import Ctl, ctl_as
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def front(live_server: Any, settings: Any) -> Iterator[GatewayServer]:
    settings.LLMGW_GATEWAY_FORWARD_TO = live_server.url
    running = GatewayServer(lifespan=True)
    yield running
    running.stop()


@pytest.fixture
def ctl(front: GatewayServer, tokens: dict[str, str], capsys: Any, monkeypatch: Any) -> Ctl:
    return ctl_as(front.url, tokens, capsys, monkeypatch)


def test_a_key_is_printed_once_and_opens_the_gateway(ctl: Any, front: GatewayServer) -> None:
    code, out, err = ctl("alice", "key", "create", "billing bot")
    assert code == 0, err
    lines = out.splitlines()
    key_id = GatewayKey.objects.get().pk  # not always 1: PostgreSQL keeps its sequences
    assert (
        lines[0] == f"Gateway key {key_id} (billing bot) created for alice. It is shown only now:"
    )
    secret = lines[2].strip()
    assert secret.startswith("llmgw-")
    assert f"base_url={front.url}/v1  api_key={secret}" in out
    assert f"Revoke it with: llmgw ctl key revoke {key_id}" in out
    # At once: a key the gateway does not know yet waits for its next look at the database.
    models = requests.get(
        f"{front.url}/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10
    )
    assert models.status_code == 200

    code, out, _ = ctl("alice", "keys")
    header, row = out.strip().splitlines()
    assert header.split() == [
        "ID",
        "KEY",
        "NAME",
        "OWNER",
        "STATE",
        "CREATED",
        "(UTC)",
        "LAST",
        "USED",
        "(UTC)",
    ]
    assert row.split()[:6] == [str(key_id), secret[:12] + "…", "billing", "bot", "alice", "active"]
    assert secret not in out


def test_keys_json_and_revoke(ctl: Any, front: GatewayServer) -> None:
    _, out, _ = ctl("alice", "key", "create", "app", "--json")
    created = json.loads(out)
    code, out, _ = ctl("alice", "keys", "--json")
    listed = json.loads(out)
    assert code == 0 and [k["id"] for k in listed] == [created["id"]] and "key" not in listed[0]

    code, out, err = ctl("bob", "key", "revoke", str(created["id"]))
    assert code == 1 and out == ""
    assert (
        err
        == f"error: There is no gateway key {created['id']} of yours; `llmgw ctl keys` lists them.\n"
    )

    def status() -> int:
        return requests.get(
            f"{front.url}/v1/models",
            headers={"Authorization": f"Bearer {created['key']}"},
            timeout=10,
        ).status_code

    assert status() == 200
    code, out, err = ctl("alice", "key", "revoke", str(created["id"]))
    revoked = time.monotonic()
    assert code == 0, err
    assert out.startswith(
        f"Gateway key {created['id']} ({created['prefix']}…, app, owned by alice) is revoked since "
    )
    assert out.rstrip().endswith("UTC: requests with it get 401.")
    # The gateway keeps keys in memory: the revocation reaches it within a second.
    wait_for(
        lambda: status() == 401,
        timeout=max(0.0, revoked + 1.0 - time.monotonic()),
        what="the revoked key refused (within 1 s of its revocation)",
    )
    _, out, _ = ctl("staff", "keys")
    assert "revoked" in out


def test_no_keys_yet(ctl: Any) -> None:
    code, out, _ = ctl("carol", "keys")
    assert code == 0 and out == "No gateway keys yet. Create one with: llmgw ctl key create NAME\n"


def test_a_key_id_must_be_a_number(ctl: Any, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        ctl("alice", "key", "revoke", "abc")
    assert (
        "'abc' is not a key id; `llmgw ctl keys` lists them (the ID column)"
        in capsys.readouterr().err
    )

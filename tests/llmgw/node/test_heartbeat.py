"""The agent's heartbeat (llmgw/node/agent.py) against the real control plane (pytest-django's live
server): what it declares of itself, and how it says what the control plane refuses or does not
believe. No engine runs here; tests/llmgw/node/test_agent.py runs them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from core.actor import Actor
from fleet.models import Node
from fleet.services import node_add
from llmgw.node.agent import Agent
from llmgw.node.config import NodeConfig

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def register(live_server: Any, users: dict[str, Any], tmp_path: Path) -> Any:
    """register(name, **config) adds a node and returns an agent for it, not yet started."""

    def agent_for(name: str = "n1", **config: Any) -> Agent:
        _, token = node_add(actor=Actor.for_user(users["staff"], "api"), name=name)
        settings = {"memory_gb": 8, "cores": 4, "cache": tmp_path / name, **config}
        return Agent(NodeConfig(server=live_server.url, token=token, **settings))

    return agent_for


def test_it_declares_its_port_range_and_the_control_plane_keeps_it(register: Any) -> None:
    agent = register(port_range=(43000, 43099))
    agent.heartbeat()
    node = Node.objects.get()
    assert node.last_heartbeat is not None
    assert (node.port_first, node.port_last, node.address) == (43000, 43099, "127.0.0.1")


def test_it_says_why_its_address_was_refused(register: Any, caplog: Any) -> None:
    """An agent on this machine that names another address for its engines: the control plane
    sees it connect from 127.0.0.1 and refuses; the agent logs the reason."""
    agent = register(address="10.0.0.5")
    with caplog.at_level(logging.WARNING, logger="llmgw.node"):
        agent.heartbeat()
    assert Node.objects.get().last_heartbeat is None
    (said,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # The live server is at "localhost", which the agent may reach over either loopback.
    said = said.replace("connects from ::1", "connects from 127.0.0.1")
    assert said.startswith(
        f"the control plane at {agent.server} refused the heartbeat (HTTP 403): This node "
        "reports its engines at 10.0.0.5, but it connects from 127.0.0.1 and 10.0.0.5 is in "
        "none of the networks staff allowed for it (none);"
    )


def test_it_logs_capacity_the_control_plane_does_not_believe_once(
    register: Any, caplog: Any
) -> None:
    first = register(memory_gb=8)
    first.heartbeat()
    # The same node restarted with more memory than it registered with.
    bigger = Agent(NodeConfig(**{**first.config.__dict__, "memory_gb": 64}))
    with caplog.at_level(logging.WARNING, logger="llmgw.node"):
        bigger.heartbeat()
        bigger.heartbeat()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "the control plane says: Node n1 reports 64 GB of memory, more than the 8 GB of memory "
        "it registered with; placement counts on 8 GB of memory until staff accept more: "
        "`llmgw ctl node accept-capacity n1` believes what it reports."
    ]
    assert Node.objects.get().memory_gb == 8

"""Fleet fixtures: nodes registered through the services, and a stand-in for their agents' heartbeats."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from typing import Any

import pytest

from tests.support.fleet import Fleet


@pytest.fixture
def fleet(users: dict[str, Any]) -> Fleet:
    return Fleet(users["staff"], users["alice"])


@pytest.fixture
def outward_address() -> str:
    """An address of this machine other than loopback (the one its default route leaves from);
    the test is skipped on a machine that has none."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # UDP: nothing is sent, only the route is looked up
        address = str(probe.getsockname()[0])
        if not ipaddress.ip_address(address).is_loopback:
            return address
    pytest.skip("this machine has no address but loopback")

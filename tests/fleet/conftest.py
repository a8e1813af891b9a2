"""Fleet fixtures: nodes registered through the services, and a stand-in for their agents' heartbeats."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.fleet import Fleet


@pytest.fixture
def fleet(users: dict[str, Any]) -> Fleet:
    return Fleet(users["staff"], users["alice"])

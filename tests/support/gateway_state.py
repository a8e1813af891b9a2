"""The state of the gateway under test: the one its application holds (tests/gateway/conftest.py
gives each test a fresh gateway with a fresh state)."""

from __future__ import annotations

from gateway.asgi import application
from gateway.state import GatewayState


def current_state() -> GatewayState:
    gateway = application.gateway
    assert gateway is not None, "no gateway: the test runs without tests/gateway/conftest.py's"
    return gateway.state

"""The gateway process stops at start on a server.yaml that does not validate, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.system import free_port

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[2]


def test_a_bad_server_yaml_stops_the_gateway_with_its_message(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - name: x\n    profiles: []\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("LLMGW", "DATABASE"))},
        "LLMGW_CONFIG": str(config),
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
    }
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "uvicorn"),
            "gateway.asgi:application",
            "--port",
            str(free_port()),
            "--workers",
            "2",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert f"llmgw gateway: cannot start: {config}: models[0] (x)" in output
    assert "line 2" in output or "line 3" in output
    assert "Traceback" not in output


def test_what_the_start_made_is_out_of_the_collectors_sight(
    transactional_db: object, settings: object
) -> None:
    """A full collection over everything a worker holds paused it for 130-350 ms every 15-30 s
    at 5,000 nodes and 20,000 replicas: what the start made is frozen, not scanned again, and
    the collections that remain come seldom (gateway.process.tune_collector)."""
    import gc

    from gateway.process import GC_YOUNG_OBJECTS
    from tests.gateway.conftest import GatewayServer

    thresholds = gc.get_threshold()
    gc.unfreeze()  # whatever this process froze before
    assert gc.get_freeze_count() == 0
    settings.LLMGW_GATEWAY_GC_FREEZE = True  # type: ignore[attr-defined]
    running = GatewayServer(lifespan=True)
    try:
        assert gc.get_freeze_count() > 10_000  # Django's modules alone are more
        assert gc.get_threshold()[0] == GC_YOUNG_OBJECTS
    finally:
        running.stop()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_the_suite_leaves_its_own_collector_alone(transactional_db: object) -> None:
    import gc

    from tests.gateway.conftest import GatewayServer

    thresholds = gc.get_threshold()
    running = GatewayServer(lifespan=True)
    try:
        assert gc.get_threshold() == thresholds
    finally:
        running.stop()

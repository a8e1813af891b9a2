"""The API's schema tells the truth: schemathesis runs every operation of /api/v1/ against a live
server, with every check on, and finds nothing (no 5xx, no answer outside the schema, no
undocumented status, no wrong input accepted).

tests/schemathesis.toml holds its settings; the README names the one it relaxes and why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.registry import LocalRegistry, available

CONFIG = Path(__file__).parent / "schemathesis.toml"


@pytest.mark.skipif(available() is not None, reason=str(available()))
@pytest.mark.django_db(transaction=True)
def test_schemathesis_finds_nothing(
    live_server: Any,
    tokens: dict[str, str],
    users: dict[str, Any],
    server_yaml: Any,
    tmp_path: Path,
) -> None:
    from catalog.definitions import clean_definition
    from catalog.services import Actor, model_add
    from fleet.services import node_add

    with LocalRegistry(tmp_path / "registry") as registry:
        registry.commit("acme/tiny", {"tiny.gguf": b"GGUF" + bytes(60)})
        server_yaml(
            {
                "registry": {"endpoint": registry.endpoint},
                "mirror": {"root": str(tmp_path / "mirror")},
            }
        )
        staff = Actor.for_user(users["staff"], "api")
        _, node_token = node_add(actor=staff, name="node-1")
        # The model tests/schemathesis.toml names for the operations on one model.
        parked = {"name": "schema-chat", "min_replicas": 0, "max_replicas": 0}
        source = f"{live_server.url}/mirror/acme/schema-chat/abc123/w.gguf"
        model_add(
            actor=staff,
            definition=clean_definition(
                {**parked, "source": source, "profiles": [{"name": "cpu", "memory_gb": 1}]}
            ),
            source_check=False,
        )
        env = {
            **os.environ,
            "LLMGW_TEST_TOKEN": tokens["staff"],
            "LLMGW_TEST_NODE_TOKEN": node_token,
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "--config-file",
                str(CONFIG),
                "run",
                f"{live_server.url}/api/v1/schema",
                "--checks",
                "all",
                "--seed",
                "20261202",
                "--workers",
                "1",
                "--no-color",
                "--generation-database",
                "none",
                "--report-dir",
                str(tmp_path / "report"),
            ],
            env=env,
            cwd=tmp_path,  # its caches stay out of the checkout
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, result.stdout[-30000:] + result.stderr[-5000:]

"""End to end: olah serving a repository with weights and a vision projector, the control plane
with worker and beat, an agent running real llama.cpp replicas. Serve the model with its
projector, ask its replica about an image, push a new projector, update, roll back: the replica
runs the projector of its weights' commit at every step."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from llmgw.cli import main
from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_mmproj, write_tiny_model
from tests.llmgw.test_engine_mmproj import image_chat_body
from tests.support.registry import LocalRegistry, available
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

REPO = "acme/tiny-vision-GGUF"
NAME = "tiny-vision-q4"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("vision")
    write_tiny_model(folder / "w1.gguf", seed=1)
    for seed in (1, 2):
        write_tiny_mmproj(folder / f"p{seed}.gguf", seed=seed)
    registry = LocalRegistry(folder / "registry")
    first = registry.commit(
        REPO, {f"{NAME}.gguf": folder / "w1.gguf", "mmproj-f32.gguf": folder / "p1.gguf"}
    )
    registry.start()
    system = System(folder / "system", config={"registry": {"endpoint": registry.endpoint}})
    try:
        with system.running():
            system.add_ready_nodes(memory_gb=3, cores=2, names=("node-a",))
            yield {"system": system, "registry": registry, "folder": folder, "first": first}
    finally:
        registry.stop()


def ctl(system: System, *argv: str, capsys: Any) -> str:
    os.environ["LLMGW_URL"], os.environ["LLMGW_TOKEN"] = system.url, system.token
    code = main(["ctl", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ready_replica(system: System) -> dict[str, Any] | None:
    live = [
        r
        for r in system.api("GET", f"models/{NAME}/target")["replicas"]
        if r["state"] != "withdrawn"
    ]
    return live[0] if len(live) == 1 and live[0]["routable"] else None


def running_projector(system: System, replica: dict[str, Any]) -> str:
    """The sha256 of the projector the replica's engine was started with: the agent's cache
    names each file by its content's sha256."""
    state = system.folder / "nodes" / replica["node"] / "replicas" / replica["id"] / "state.json"
    command = json.loads(state.read_text())["command"]
    return Path(command[command.index("--mmproj") + 1]).name


def on_projector(system: System, digest: str) -> dict[str, Any] | None:
    replica = ready_replica(system)
    return replica if replica and running_projector(system, replica) == digest else None


def answers_an_image(system: System, replica: dict[str, Any]) -> None:
    answer = requests.post(
        f"http://127.0.0.1:{replica['port']}/v1/chat/completions",
        json=image_chat_body(),
        headers={"Authorization": f"Bearer {system.engine_key(replica)}"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text


def test_serve_with_a_projector_update_it_and_roll_back(world: dict[str, Any], capsys: Any) -> None:
    system, registry, folder = world["system"], world["registry"], world["folder"]
    old, new = sha(folder / "p1.gguf"), sha(folder / "p2.gguf")

    out = ctl(
        system, "model", "serve", REPO, "--mmproj", "mmproj-f32.gguf", "--memory", "1",
        capsys=capsys,
    )  # fmt: skip
    assert f"Fetching {NAME}.gguf, mmproj-f32.gguf from {REPO}" in out
    replica = wait_for(lambda: on_projector(system, old), timeout=120, what="a replica on p1")
    answers_an_image(system, replica)

    new_commit = registry.commit(REPO, {"mmproj-f32.gguf": folder / "p2.gguf"}, message="p2")
    out = ctl(system, "model", "updates", "--check", capsys=capsys)
    row = out.strip().splitlines()[-1].split()
    assert row[0] == NAME and row[2] == new_commit[:7] and row[3] == "mmproj-f32.gguf"

    out = ctl(system, "model", "update", NAME, "--wait", capsys=capsys)
    assert "done: every replica runs" in out
    replica = wait_for(lambda: on_projector(system, new), timeout=120, what="a replica on p2")
    answers_an_image(system, replica)

    out = ctl(system, "model", "rollback", NAME, "--wait", capsys=capsys)
    assert "done:" in out
    replica = wait_for(lambda: on_projector(system, old), timeout=120, what="p1 again")
    answers_an_image(system, replica)

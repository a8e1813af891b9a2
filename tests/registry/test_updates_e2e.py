"""End to end: olah serving git-lfs repositories, the control plane with worker and beat, two agents
running real llama.cpp replicas. Serve a repo, push new weights, see the update, roll it out and
back, with a ready replica at every moment."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.cli import main
from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support import waiting
from tests.support.registry import LocalRegistry, available
from tests.support.system import System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

REPO = "acme/tiny-chat-GGUF"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("updates")
    for seed in (1, 2):
        write_tiny_model(folder / f"w{seed}.gguf", seed=seed)
    registry = LocalRegistry(folder / "registry")
    registry.commit(REPO, {"tiny-chat-q4.gguf": folder / "w1.gguf"})
    registry.start()
    system = System(folder / "system", config={"registry": {"endpoint": registry.endpoint}})
    try:
        with system.running():
            system.add_ready_nodes(memory_gb=3, cores=2, names=("node-a", "node-b"))
            yield {"system": system, "registry": registry, "folder": folder}
    finally:
        registry.stop()


def ctl(system: System, *argv: str, capsys: Any) -> str:
    import os

    os.environ["LLMGW_URL"], os.environ["LLMGW_TOKEN"] = system.url, system.token
    code = main(["ctl", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def replicas(system: System) -> list[dict[str, Any]]:
    return system.api("GET", "models/tiny-chat-q4/target")["replicas"]


def all_on(system: System, digest: str) -> bool:
    live = [r for r in replicas(system) if r["state"] != "withdrawn"]
    return len(live) == 2 and all(r["routable"] and r["weights_sha256"] == digest for r in live)


def roll(system: System, argv: list[str], capsys: Any) -> tuple[str, int]:
    """Run a rollout with --wait while watching that a replica is ready at every moment."""
    result: dict[str, Any] = {}

    def run() -> None:
        import os

        os.environ["LLMGW_URL"], os.environ["LLMGW_TOKEN"] = system.url, system.token
        result["code"] = main(["ctl", *argv])

    thread = threading.Thread(target=run)
    thread.start()
    lowest = 99

    def watched_to_the_end() -> bool:
        nonlocal lowest
        ready = [r for r in replicas(system) if r["routable"]]
        lowest = min(lowest, len(ready))
        assert ready, "no ready replica during the rollout"
        return not thread.is_alive()

    # A look every 0.1 s while the command runs; not_yet=(): an API that fails fails the test.
    waiting.wait_for(
        watched_to_the_end,
        timeout=600,
        interval=0.1,
        what=f"`llmgw ctl {' '.join(argv)}` to return",
        not_yet=(),
    )
    thread.join()
    out, err = capsys.readouterr()
    assert result["code"] == 0, err
    return out, lowest


def test_serve_update_and_rollback(world: dict[str, Any], capsys: Any) -> None:
    system, registry, folder = world["system"], world["registry"], world["folder"]
    old, new = sha(folder / "w1.gguf"), sha(folder / "w2.gguf")

    out = ctl(system, "model", "serve", REPO, "--min", "2", "--memory", "1", capsys=capsys)
    assert "tiny-chat-q4 added, owned by admin" in out
    wait_for(lambda: all_on(system, old), timeout=120, what="two replicas on the first weights")

    out = ctl(system, "model", "updates", "--check", capsys=capsys)
    assert "Every served model is on the newest files" in out
    new_commit = registry.commit(
        REPO, {"tiny-chat-q4.gguf": folder / "w2.gguf"}, message="retrained"
    )
    out = ctl(system, "model", "updates", "--check", capsys=capsys)
    row = out.strip().splitlines()[-1].split()
    assert row[0] == "tiny-chat-q4" and row[2] == new_commit[:7] and row[3] == "tiny-chat-q4.gguf"

    out, lowest = roll(system, ["ctl", "model", "update", "tiny-chat-q4", "--wait"][1:], capsys)
    assert "done: every replica runs" in out and lowest >= 1
    assert all_on(system, new)

    out, lowest = roll(system, ["ctl", "model", "rollback", "tiny-chat-q4", "--wait"][1:], capsys)
    assert "done:" in out and lowest >= 1
    assert all_on(system, old)
    # The weights rolled back from stay the update available, the next check too (issue 44).
    for argv in (["model", "updates", "--json"], ["model", "updates", "--check", "--json"]):
        [update] = json.loads(ctl(system, *argv, capsys=capsys))["updates"]
        assert (update["model"], update["new_commit"]) == ("tiny-chat-q4", new_commit)
        assert update["rolled_back_from"] == new_commit

    audit = system.api("GET", "audit", params={"model": "tiny-chat-q4"})["entries"]
    steps = [(e["action"], e["actor"]) for e in reversed(audit)]
    for step in [
        ("add", "admin"),
        ("update", "admin"),
        ("update-swap", "admin"),
        ("update-done", "system"),
        ("rollback", "admin"),
        ("rollback-done", "system"),
    ]:
        assert step in steps, steps

"""End to end: canary updates on a whole llmgw (gateway, web, worker with beat, two node agents
running llama.cpp replicas, olah serving the repository), with the official `openai` client
sending requests throughout.

What is real: the registry, the mirror, every process, the engines on every weights file, the
gateway's split and figures, the checks and the rollback. What is not: the failure of the bad
revision. Its weights are real and a real llama-server loads them and passes the agent's
readiness check, but a stand-in in front of that engine (tests/support/faulty_engine.py, run by
the agents for that one file) answers 500 to every request for more than one token.
"""

from __future__ import annotations

import hashlib
import importlib.util
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_model
from tests.support.registry import LocalRegistry, available
from tests.support.system import ROOT, System, wait_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.skipif(
        importlib.util.find_spec("openai") is None, reason="openai is not installed"
    ),
]

REPO = "acme/tiny-chat-GGUF"
NAME = "tiny-chat-q4"
CHECK_SECONDS = 2
MIN_REQUESTS = 8


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("canary")
    weights = {}
    for seed in (1, 2, 3):
        weights[seed] = folder / f"w{seed}.gguf"
        write_tiny_model(weights[seed], seed=seed)
    engine = folder / "engine"
    engine.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{ROOT}/tests/support/faulty_engine.py" "$@"\n'
    )
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    registry = LocalRegistry(folder / "registry")
    registry.commit(REPO, {"tiny-chat-q4.gguf": weights[1]})
    registry.start()
    system = System(folder / "system", config={"registry": {"endpoint": registry.endpoint}})
    system.env.update(
        {
            "LLMGW_CANARY_CHECK_SECONDS": str(CHECK_SECONDS),
            "LLMGW_CANARY_MIN_REQUESTS": str(MIN_REQUESTS),
            "LLMGW_LLAMA_SERVER": str(engine),
            "LLMGW_REAL_LLAMA_SERVER": str(find_engine()),
            "LLMGW_FAULTY_SHA256": sha(weights[3]),
        }
    )
    try:
        with system.running():
            system.add_ready_nodes(memory_gb=3, cores=2, names=("node-a", "node-b"))
            system.api("POST", "serve", json={"repo": REPO, "min": 2, "memory_gb": 1})
            wait_for(lambda: on(system, sha(weights[1])), timeout=180, what="two replicas on w1")
            key = system.api("POST", "keys", json={"name": "canary-e2e"})["key"]
            attacker = system.api("POST", "keys", json={"name": "someone-else"})["key"]
            yield {
                "system": system,
                "registry": registry,
                "weights": weights,
                "key": key,
                "attacker": attacker,
            }
    finally:
        registry.stop()


def live(system: System) -> list[dict[str, Any]]:
    import requests

    answer = requests.get(
        f"{system.url}/api/v1/models/{NAME}/target", headers=system.headers, timeout=30
    )
    if answer.status_code == 404:
        return []  # not added yet: its files are still being fetched
    answer.raise_for_status()
    replicas = answer.json()["replicas"]
    return [r for r in replicas if r["state"] != "withdrawn"]


def on(system: System, digest: str) -> bool:
    replicas = live(system)
    return len(replicas) == 2 and all(
        r["routable"] and r["weights_sha256"] == digest for r in replicas
    )


class Traffic:
    """Two clients sending chat requests through the gateway until stopped; each answer is
    noted with the revision that gave it (X-LLMGW-Revision)."""

    def __init__(self, system: System, key: str) -> None:
        import openai

        # No client-side retries: every failed request must count as one.
        self.client = openai.OpenAI(
            base_url=f"{system.url}/v1", api_key=key, max_retries=0, timeout=60
        )
        self.ok: list[str] = []
        self.failed: list[tuple[str, str]] = []  # (revision, what)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(2)]

    def _run(self) -> None:
        import openai

        while not self._stop.is_set():
            try:
                answer = self.client.chat.completions.with_raw_response.create(
                    model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4
                )
                answer.parse()
                self.ok.append(answer.headers.get("x-llmgw-revision", ""))
            except openai.APIStatusError as exc:
                revision = exc.response.headers.get("x-llmgw-revision", "")
                self.failed.append((revision, f"{exc.status_code}: {exc.message}"))
            except openai.APIError as exc:
                self.failed.append(("", repr(exc)))

    def answered(self) -> int:
        """Requests answered so far, well or not."""
        return len(self.ok) + len(self.failed)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


ATTACK_BODIES = [
    b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
    b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "%s", "messages": [{"role": 7, "content": "hi"}]}',
    b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "image_url", '
    b'"image_url": {"url": "data:image/png;base64,AAAA"}}]}]}',
]


def attack(system: System, key: str, count: int) -> list[int]:
    """`count` requests the engine would fail on, as one key sends them; their statuses."""
    import requests

    statuses = []
    with requests.Session() as session:
        for number in range(count):
            body = ATTACK_BODIES[number % len(ATTACK_BODIES)].replace(b"%s", NAME.encode())
            answer = session.post(
                f"{system.url}/v1/chat/completions",
                data=body,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                timeout=30,
            )
            statuses.append(answer.status_code)
            assert "x-llmgw-revision" not in answer.headers  # no replica saw it
    return statuses


def canary(system: System) -> dict[str, Any]:
    return system.api("GET", f"models/{NAME}/canary")


def test_a_healthy_canary_is_promoted_and_the_rollout_completes(world: dict[str, Any]) -> None:
    system, weights = world["system"], world["weights"]
    new = sha(weights[2])[:12]
    old_ids = {r["id"] for r in live(system)}
    world["registry"].commit(REPO, {"tiny-chat-q4.gguf": weights[2]}, message="retrained")
    system.api("POST", "updates/check")
    with Traffic(system, world["key"]) as traffic:
        rollout = system.api(
            "POST",
            f"models/{NAME}/update",
            # Replicas share two cores with everything else here: a latency ratio of 2 could
            # be crossed by a busy moment; this test is about a healthy canary going on.
            json={"canary": 30, "for": "20s", "max_latency_ratio": 5},
        )
        assert rollout["kind"] == "update"
        shown = wait_for(
            lambda: (c := canary(system))["state"] == "watching" and c,
            timeout=180,
            what="the canary replica ready",
        )
        # Another key sends what the engine answered with a 500 before the gateway checked
        # bodies (issue 19: 187 such requests rolled a healthy canary back in 15 s): each is
        # now the client's 400, and none counts against either revision.
        attacks = attack(system, world["attacker"], 187)
        assert set(attacks) == {400}, attacks
        # One replica on the new weights beside both old ones, which all serve.
        assert len(live(system)) == 3 and old_ids <= {r["id"] for r in live(system)}
        # A model served before any update knows its file by where it is (its revision is a
        # digest of that); after an update, by its checksum.
        assert shown["revision"] == new
        old = shown["from_revision"]
        wait_for(lambda: canary(system)["state"] == "promoted", timeout=120, what="promotion")
        wait_for(lambda: on(system, sha(weights[2])), timeout=180, what="every replica on w2")
        wait_for(
            lambda: system.api("GET", f"models/{NAME}/rollout")["state"] == "done",
            timeout=30,
            what="the rollout done",
        )
    assert traffic.failed == []
    assert traffic.ok.count(new) >= MIN_REQUESTS and traffic.ok.count(old) > 0
    decided = canary(system)
    assert decided["decided_by"] == "system"
    assert decided["decision"].startswith("healthy through the window: 0 server errors")
    assert decided["new"]["requests"] >= MIN_REQUESTS and decided["old"]["requests"] > 0


def ctl(system: System, capsys: Any, *argv: str) -> str:
    import os

    from llmgw.cli import main

    os.environ["LLMGW_URL"], os.environ["LLMGW_TOKEN"] = system.url, system.token
    code = main(["ctl", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_a_failing_canary_is_rolled_back_with_no_failure_on_the_old_revision(
    world: dict[str, Any], capsys: Any
) -> None:
    system, weights = world["system"], world["weights"]
    old, bad = sha(weights[2])[:12], sha(weights[3])[:12]
    old_ids = {r["id"] for r in live(system)}
    world["registry"].commit(REPO, {"tiny-chat-q4.gguf": weights[3]}, message="broken")
    system.api("POST", "updates/check")
    with Traffic(system, world["key"]) as traffic:
        out = ctl(system, capsys, "model", "update", NAME, "--canary", "30", "--for", "5m")
        assert "first a canary: one replica on the new files gets 30% of the requests" in out
        wait_for(lambda: canary(system)["state"] == "watching", timeout=180, what="the canary")
        out = ctl(system, capsys, "model", "updates")
        assert out.startswith(f"{NAME}: canary of ") and "REQUESTS" in out
        decided = wait_for(
            lambda: (c := canary(system))["state"] == "rolled back" and c,
            timeout=120,
            what="the automatic rollback",
        )
        wait_for(lambda: on(system, sha(weights[2])), timeout=60, what="the canary replica gone")
        # Requests go on after the rollback, all to the old revision (asserted below).
        answered = traffic.answered()
        wait_for(
            lambda: traffic.answered() >= answered + 20,
            timeout=60,
            what="20 more requests answered after the rollback",
        )
    assert {r["id"] for r in live(system)} == old_ids  # the old replicas never stopped
    assert traffic.failed, "the bad revision answered no request at all"
    assert [f for f in traffic.failed if f[0] != bad] == []  # every failure was the canary's
    assert traffic.ok and set(traffic.ok) == {old}
    assert decided["decided_by"] == "system"
    assert decided["decision"].startswith("unhealthy: server errors on the new revision")
    assert decided["new"]["server_errors"] >= MIN_REQUESTS * 0.05
    assert decided["old"]["server_errors"] == 0
    rollout = system.api("GET", f"models/{NAME}/rollout")
    assert rollout["state"] == "failed" and rollout["message"].startswith("canary rolled back")
    audit = system.api("GET", "audit", params={"model": NAME, "action": "canary-rollback"})
    [entry] = audit["entries"]
    assert entry["actor"] == "system"
    assert "new revision:" in entry["note"] and "old revision:" in entry["note"]
    started = decided["started_at"]
    print(
        f"\nbad canary: rolled back after {decided['checks']} checks, "
        f"window started {started}, decided {decided['decided_at']}; "
        f"{len(traffic.failed)} failed answers, all from {bad}; {len(traffic.ok)} from {old}"
    )

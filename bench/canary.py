"""How long a bad canary serves before it is rolled back, on a whole llmgw with real replicas.

A whole system runs (gateway, web, worker with beat, two node agents running llama.cpp replicas,
olah with a repository): two replicas on good weights, then updates to weights that a real
llama-server loads and passes the readiness check with, but that fail every real request (a
stand-in in front of that engine answers 500, tests/support/faulty_engine.py). Four clients send
requests throughout. Each round starts the canary update (25% of the requests, a 10 m window),
waits for the automatic rollback, and reads the canary's record: the checks it took and the
seconds from the window's start (the control plane seeing its replica ready) to the rollback,
and from the replica being ready to the rollback. The same update is tried again in the next
round (a rollback leaves it available).

Printed beside issue 14's target: rolled back within 2 checks of the window's start.

Run: make bench, or .venv/bin/python bench/canary.py [--rounds 3 --check-seconds 15]
"""

from __future__ import annotations

import argparse
import hashlib
import stat
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REPO = "bench/tiny-chat"
NAME = "tiny-chat"
CLIENTS = 4
TARGET_CHECKS = 2


class Traffic:
    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.answers: list[tuple[float, int, str]] = []  # (when, status, revision that answered)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(CLIENTS)]

    def _run(self) -> None:
        import requests

        session = requests.Session()
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        while not self._stop.is_set():
            try:
                answer = session.post(
                    f"{self.url}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {self.key}"},
                    timeout=60,
                )
                status, revision = answer.status_code, answer.headers.get("X-LLMGW-Revision", "")
            except requests.RequestException:
                status, revision = 0, ""
            self.answers.append((time.time(), status, revision))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check-seconds", type=int, default=15)
    parser.add_argument("--min-requests", type=int, default=20)
    args = parser.parse_args()

    from llmgw.engine import find_engine
    from llmgw.tinygguf import write_tiny_model
    from tests.support.registry import LocalRegistry
    from tests.support.system import System, wait_for

    real = find_engine()
    if real is None:
        raise SystemExit("canary: llama-server is not built (make setup builds it)")
    folder = Path(tempfile.mkdtemp(prefix="llmgw-bench-canary-"))
    good, bad = folder / "good.gguf", folder / "bad.gguf"
    write_tiny_model(good, seed=1)
    write_tiny_model(bad, seed=2)
    engine = folder / "engine"
    engine.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{ROOT}/tests/support/faulty_engine.py" "$@"\n'
    )
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    registry = LocalRegistry(folder / "registry")
    registry.commit(REPO, {"tiny-chat.gguf": good})
    registry.start()
    system = System(folder / "system", config={"registry": {"endpoint": registry.endpoint}})
    system.env.update(
        {
            "LLMGW_CANARY_CHECK_SECONDS": str(args.check_seconds),
            "LLMGW_CANARY_MIN_REQUESTS": str(args.min_requests),
            "LLMGW_LLAMA_SERVER": str(engine),
            "LLMGW_REAL_LLAMA_SERVER": real,
            "LLMGW_FAULTY_SHA256": hashlib.sha256(bad.read_bytes()).hexdigest(),
        }
    )
    traffic: Traffic | None = None
    try:
        system.start()
        system.add_node("node-a", memory_gb=3, cores=2)
        system.add_node("node-b", memory_gb=3, cores=2)
        system.api("POST", "serve", json={"repo": REPO, "min": 2, "memory_gb": 1})

        def ready_replicas() -> int:
            import requests

            answer = requests.get(
                f"{system.url}/api/v1/models/{NAME}/target", headers=system.headers, timeout=30
            )
            if answer.status_code == 404:
                return 0
            return sum(r["routable"] for r in answer.json()["replicas"])

        wait_for(lambda: ready_replicas() == 2, timeout=300, what="two replicas")
        registry.commit(REPO, {"tiny-chat.gguf": bad}, message="broken")
        system.api("POST", "updates/check")
        key = system.api("POST", "keys", json={"name": "bench"})["key"]
        traffic = Traffic(system.url, key)
        traffic.start()
        rows = []
        for _ in range(args.rounds):
            wait_for(lambda: ready_replicas() == 2, timeout=120, what="two ready replicas")
            asked = time.time()
            system.api("POST", f"models/{NAME}/update", json={"canary": 25, "for": "10m"})
            canary: dict[str, Any] = wait_for(
                lambda: (
                    (c := system.api("GET", f"models/{NAME}/canary"))["state"]
                    in ("rolled back", "aborted", "promoted", "ended")
                    and c
                ),
                timeout=600,
                interval=0.5,
                what="the canary's end",
            )
            if canary["state"] != "rolled back":
                raise SystemExit(f"canary: the bad canary ended {canary['state']}: {canary}")
            started = datetime.fromisoformat(canary["started_at"]).timestamp()
            decided = datetime.fromisoformat(canary["decided_at"]).timestamp()
            # Its replica served from when the gateway first sent it a request that failed.
            failures = [w for w, status, _ in traffic.answers if w >= asked and status >= 500]
            first = min(failures) if failures else started
            rows.append((canary["checks"], decided - started, decided - first, canary["new"]))
        traffic.stop()
        print(
            f"canary: a bad canary (25% of the requests, every one failing), {CLIENTS} clients, a "
            f"check every {args.check_seconds}s, decided on at least {args.min_requests} answers"
        )
        print(
            f"{'round':>5} {'checks':>6} {'s after window start':>21} {'s it served':>12} {'its answers':>12}"
        )
        for index, (checks, after_start, served, new) in enumerate(rows, 1):
            print(
                f"{index:>5} {checks:>6} {after_start:>21.1f} {served:>12.1f} {new['requests']:>12}"
            )
        worst = max(r[0] for r in rows)
        median_s = statistics.median(r[1] for r in rows)
        verdict = "met" if worst <= TARGET_CHECKS else "NOT met"
        print(
            f"canary: rolled back within {worst} check(s) of the window's start at worst, median "
            f"{median_s:.1f}s after it (target: within {TARGET_CHECKS} checks of the window's "
            f"start: {verdict})"
        )
        bad_revision = rows and canary["revision"]
        failed = [(status, rev) for _, status, rev in traffic.answers if status != 200]
        print(
            f"canary: {len(traffic.answers)} answers in all; failed: "
            f"{sum(rev == bad_revision for _, rev in failed)} from the bad revision, "
            f"{sum(rev != bad_revision for _, rev in failed)} from the old one (must be 0)"
        )
    finally:
        if traffic is not None:
            traffic.stop()
        system.close()
        registry.stop()


if __name__ == "__main__":
    main()

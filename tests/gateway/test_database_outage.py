"""The gateway through a database outage: PostgreSQL stopped for 30 s while the official `openai`
client keeps asking, with real gateway processes (uvicorn's two workers) on a PostgreSQL server of
the test's own (tests.support.postgres), never the machine's.

Keys, models and replicas known before are answered from memory (none fails); each process logs
one line when it loses the database and one when it is back, and /metrics says so; the traffic
figures and usage of the requests answered meanwhile are written once it is back, none lost and
none counted twice; a key made after it is back works at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.gateway.fake_engine import FakeEngine
from tests.support import postgres
from tests.support.gateway_processes import chat_on_engine
from tests.support.system import System, wait_for
from tests.support.waiting import stays

pytestmark = pytest.mark.skipif(not postgres.AVAILABLE, reason="needs PostgreSQL's initdb")

OUTAGE_SECONDS = 30

# After chat_on_engine's script (alice's `actor`): her key.
_KEY = """
key, secret = key_create(actor=actor, name="before")
print("KEY=" + secret)
"""

_NEW_KEY = """
from django.contrib.auth import get_user_model
from core.actor import Actor
from access.services import key_create

actor = Actor.for_user(get_user_model().objects.get(username="alice"), "api")
key, secret = key_create(actor=actor, name="after")
print("KEY=" + secret)
"""

_FIGURES = """
from django.db.models import Sum
from access.models import KeyUsageDay, TrafficMinute

minutes = TrafficMinute.objects.filter(model="chat").aggregate(n=Sum("requests"))["n"] or 0
days = KeyUsageDay.objects.filter(model="chat").aggregate(n=Sum("requests"))["n"] or 0
print(f"FIGURES={minutes},{days}")
"""


@pytest.fixture
def server() -> Iterator[postgres.PostgresServer]:
    running = postgres.PostgresServer()
    try:
        running.start()
        yield running
    finally:
        running.close()


class Traffic:
    """One client asking again and again, through the official openai client, counting answers."""

    def __init__(self, url: str, secret: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0, timeout=10)
        self.answered = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}]
                )
                self.answered += 1
            except Exception as exc:  # every failure is a finding: kept and shown
                self.failed.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)  # paces the load generator: twenty requests a second

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _figures(system: System) -> tuple[int, int]:
    printed = system.manage("shell", "-c", _FIGURES)
    minutes, days = printed.split("FIGURES=")[1].strip().split(",")
    return int(minutes), int(days)


def _metric(url: str, name: str) -> float | None:
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_the_gateway_answers_through_a_database_outage(
    tmp_path: Path,
    engine: FakeEngine,
    server: postgres.PostgresServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DATABASE_URL", server.admin_url)
    system = System(tmp_path / "system")  # its database is made on the test's server
    try:
        system.manage("migrate", "--verbosity", "0")
        printed = system.manage("shell", "-c", chat_on_engine(engine.port) + _KEY)
        secret = printed.split("KEY=")[1].strip()
        system.start_gateway(workers=2)
        headers = {"Authorization": f"Bearer {secret}"}
        wait_for(
            lambda: requests.get(f"{system.url}/v1/models", headers=headers, timeout=2).ok,
            timeout=60,
            what="the gateway",
        )
        log = system.logs["gateway"]

        with Traffic(system.url, secret) as traffic:
            wait_for(
                lambda: traffic.answered >= 10 or traffic.failed,
                timeout=30,
                what="ten answers before the outage",
            )
            server.stop()
            stopped_at = time.monotonic()
            wait_for(
                lambda: _metric(system.url, "llmgw_gateway_database_up") == 0,
                timeout=10,
                what="the gateway to see the database gone",
            )
            answered_before_outage = traffic.answered
            # Time is what is tested: the outage lasts OUTAGE_SECONDS, every request answered
            # (the first failure ends the test, with what failed).
            try:
                stays(
                    lambda: not traffic.failed,
                    seconds=max(0.0, OUTAGE_SECONDS - (time.monotonic() - stopped_at)),
                    interval=0.1,
                    what="every request answered while the database is away",
                )
            except AssertionError as stopped:
                raise AssertionError(f"{stopped}: {traffic.failed[:5]}") from None
            answered_in_outage = traffic.answered - answered_before_outage
            server.start()
            wait_for(
                lambda: _metric(system.url, "llmgw_gateway_database_up") == 1,
                timeout=30,
                what="the gateway to see the database back",
            )
            wait_for(
                lambda: log.read_text().count("the database is back") >= 2,
                timeout=30,
                what="both gateway processes to log the database back",
            )

        print(
            f"database outage of {OUTAGE_SECONDS} s: {traffic.answered} answered in all, "
            f"{answered_in_outage} during the outage, {len(traffic.failed)} failed"
        )
        assert traffic.failed == [], traffic.failed[:5]
        assert answered_in_outage > 100, answered_in_outage  # it kept answering throughout
        text = log.read_text()
        # Every process logged the loss once and the return once, whatever the retries.
        assert text.count("lost the database") == 2, text[-3000:]
        assert text.count("the database is back") == 2, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert _metric(system.url, "llmgw_gateway_database_outages_total") == 2

        # Nothing lost, nothing counted twice: every answer is in the minutes and in the key's day.
        wait_for(
            lambda: _figures(system) == (traffic.answered, traffic.answered),
            timeout=30,
            what=f"{traffic.answered} requests in the traffic figures",
        )

        # A key made once the database is back is known within a look or two.
        printed = system.manage("shell", "-c", _NEW_KEY)
        after = printed.split("KEY=")[1].strip()
        response = requests.post(
            f"{system.url}/v1/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {after}"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
    finally:
        system.close()

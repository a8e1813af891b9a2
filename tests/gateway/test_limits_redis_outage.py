"""A slow, silent or lost Redis, as gateway processes started by the run command meet it: the
requests whose limits need no Redis are never held behind it, and those that do follow
LLMGW_LIMITS_REDIS_FALLBACK (gateway.redislimits).

Each test starts its own redis-server behind a TCP proxy (tests.support.tcp_delay) that can hold
back what the gateway sends it, a fake engine, and one gateway process on a database of its own.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from access.models import hash_key
from gateway import limits, redislimits
from tests.gateway.fake_engine import FakeEngine
from tests.support.gateway_processes import ASK, chat_on_engine, start_gateways
from tests.support.redis_server import RedisServer
from tests.support.system import System, wait_for
from tests.support.tcp_delay import TcpDelay
from tests.support.waiting import stays

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[TcpDelay]:
    with TcpDelay(redis_server.port) as running:
        yield running


def with_keys(system: System, engine_port: int, **limited: Any) -> dict[str, str]:
    """The system's database with chat on the engine, a key with `limited` ("limited") and one
    without limits ("free"): their secrets."""
    system.manage("migrate", "--verbosity", "0")
    script = chat_on_engine(engine_port) + (
        "import json\n"
        "limited, secret = key_create(actor=actor, name='limited')\n"
        f"GatewayKey.objects.filter(pk=limited.pk).update(**{limited!r})\n"
        "free = key_create(actor=actor, name='free')[1]\n"
        "print('KEYS=' + json.dumps({'limited': secret, 'free': free}))\n"
    )
    return json.loads(system.manage("shell", "-c", script).split("KEYS=")[1])


def ask(url: str, secret: str) -> requests.Response:
    headers = {"Authorization": f"Bearer {secret}"}
    return requests.post(f"{url}/v1/completions", json=ASK, headers=headers, timeout=60)


def listed(url: str, secret: str) -> requests.Response:
    headers = {"Authorization": f"Bearer {secret}"}
    return requests.get(f"{url}/v1/models", headers=headers, timeout=60)


def figure(url: str, name: str) -> float:
    """A metric's value from the gateway's /metrics (0 when absent)."""
    scraped = requests.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", scraped, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_request_waiting_for_a_slow_redis_holds_up_no_other_request(
    tmp_path: Path, engine: FakeEngine, proxy: TcpDelay
) -> None:
    """Redis answers nothing while the proxy holds (the timeout is long, so no fallback): the
    limited request waits for it, and meanwhile the gateway answers the key without limits,
    again and again; once Redis answers, the limited request is let through by its count."""
    system = System(tmp_path / "system")
    try:
        secrets = with_keys(system, engine.port, rpm=1000)
        env = {**system.env, "LLMGW_LIMITS_REDIS": proxy.url, "LLMGW_LIMITS_REDIS_TIMEOUT": "30"}
        [url] = start_gateways(system, secrets["free"], [env])
        assert ask(url, secrets["limited"]).status_code == 200  # counted in Redis
        wait_for(
            lambda: figure(url, "llmgw_gateway_limits_redis_pending_entries") == 0,
            what="its end written to Redis",
        )
        proxy.hold()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(ask, url, secrets["limited"])
            wait_for(lambda: proxy.held > 0, what="the limited request's call to Redis, held")
            for _ in range(5):
                assert listed(url, secrets["free"]).status_code == 200
                assert ask(url, secrets["free"]).status_code == 200
                assert not waiting.done()  # still waiting for Redis, and only it
            assert proxy.held > 0
            proxy.release()
            answered = waiting.result(timeout=30)
        assert answered.status_code == 200
        assert answered.headers["x-ratelimit-remaining-requests"] == "998"  # Redis's count
        assert figure(url, "llmgw_gateway_limits_redis_errors_total") == 0
        assert figure(url, "llmgw_gateway_limits_redis_down") == 0
    finally:
        system.close()


def test_what_redis_counted_after_the_timeout_is_given_back(
    tmp_path: Path, engine: FakeEngine, redis_server: RedisServer, proxy: TcpDelay
) -> None:
    """Redis answers after the request stopped waiting (the fallback let it through): its count
    there, in flight among them, is given back once the late answer comes."""
    system = System(tmp_path / "system")
    try:
        secrets = with_keys(system, engine.port, max_parallel=5)
        env = {**system.env, "LLMGW_LIMITS_REDIS": proxy.url, "LLMGW_LIMITS_REDIS_TIMEOUT": "0.3"}
        [url] = start_gateways(system, secrets["free"], [env])
        assert ask(url, secrets["limited"]).status_code == 200  # counted in Redis, and ended
        counts = redis.Redis.from_url(redis_server.url)
        ident = limits.key_ident(hash_key(secrets["limited"]))

        def in_flight() -> list[bytes]:
            fields = counts.hgetall(redislimits.KEY_PREFIX + ident)
            return [name for name, value in fields.items() if name.startswith(b"f:") and int(value)]

        wait_for(lambda: not in_flight(), what="the first request's end written to Redis")
        proxy.hold()
        late = ask(url, secrets["limited"])
        assert late.status_code == 200  # the fallback (alone) let it through
        proxy.release()  # Redis gets the admission now, and counts it
        wait_for(lambda: proxy.held == 0, what="the admission passed on to Redis")
        wait_for(lambda: not in_flight(), timeout=20, what="the late count given back")
        # And it stays given back (a count left there would hold one of the 5 for good).
        stays(lambda: not in_flight(), seconds=1.5, what="nothing counted in flight")
        counts.close()
        assert figure(url, 'llmgw_gateway_limits_redis_fallback_total{fallback="alone"}') == 1
    finally:
        system.close()


@pytest.mark.parametrize("fallback", ["alone", "refuse"])
def test_while_redis_is_down_limited_requests_follow_the_fallback(
    tmp_path: Path, engine: FakeEngine, redis_server: RedisServer, proxy: TcpDelay, fallback: str
) -> None:
    system = System(tmp_path / "system")
    try:
        secrets = with_keys(system, engine.port, rpm=3)
        env = {
            **system.env,
            "LLMGW_LIMITS_REDIS": proxy.url,
            "LLMGW_LIMITS_REDIS_FALLBACK": fallback,
        }
        [url] = start_gateways(system, secrets["free"], [env])
        assert ask(url, secrets["limited"]).status_code == 200  # counted in Redis
        redis_server.stop()
        answers = [ask(url, secrets["limited"]) for _ in range(3)]
        # The key without limits does not notice.
        assert [ask(url, secrets["free"]).status_code for _ in range(3)] == [200] * 3
        if fallback == "refuse":
            assert [a.status_code for a in answers] == [503] * 3
            error = answers[0].json()["error"]
            assert error["code"] == "limits_unreachable"
            assert error["message"].startswith(
                "This key's limits are counted over every gateway machine, and where they are "
                "counted cannot be reached just now; try again in "
            )
            assert 1 <= int(answers[0].headers["Retry-After"]) <= 5
        else:
            # This machine's own counts: the one let through before, then two more of 3.
            assert [a.status_code for a in answers] == [200, 200, 429]
        assert (
            figure(url, f'llmgw_gateway_limits_redis_fallback_total{{fallback="{fallback}"}}') == 3
        )
        assert figure(url, "llmgw_gateway_limits_redis_down") == 1
        log = system.logs["gateway-0"].read_text()
        assert "Redis cannot be reached for the limits" in log
        assert f"LLMGW_LIMITS_REDIS_FALLBACK={fallback}" in log
        # Back (empty): after its pause, the gateway counts in Redis again.
        redis_server.start()

        def counted_in_redis() -> bool:
            answered = ask(url, secrets["limited"]).status_code == 200
            return answered and figure(url, "llmgw_gateway_limits_redis_down") == 0

        wait_for(counted_in_redis, timeout=30, interval=0.5, what="the limits counted in Redis")
        assert "Redis is reached again" in system.logs["gateway-0"].read_text()
    finally:
        system.close()

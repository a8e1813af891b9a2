"""Keys' and teams' rates over several gateway machines, counted in Redis (gateway.redislimits).

Each test starts its own redis-server on a free port in a temporary folder (some stop it), and
stops it by pid. Two "machines" are two gateway processes with folders of their own (nothing
shared on disk) and the same database and Redis.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from gateway import limits, redislimits
from gateway.limits import SharedCounters, limits_of, no_budgets
from gateway.redislimits import RedisLimits
from tests.gateway.fake_engine import FakeEngine
from tests.support.gateway_processes import ask_in_turn, limited_key, start_gateways
from tests.support.redis_server import RedisServer
from tests.support.system import free_port, wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class Machine:
    """One machine's counters (a gateway process's), counting together with others in Redis,
    deciding on an event loop of their own as a gateway process does."""

    def __init__(self, folder: Path, url: str, errors: list[int] | None = None, **options: Any):
        self.counters = SharedCounters(folder, writer=f"w-{folder.name}")
        self.remote = self.counters.remote = RedisLimits(
            url, on_error=None if errors is None else (lambda: errors.append(1)), **options
        )
        self.runner = asyncio.Runner()

    def admit(
        self, key_id: int, key: limits.Limits, team: limits.Limits | None, budgets: Any,
        reserve: int = 0,
    ) -> limits.Admission | limits.OverLimit:  # fmt: skip
        return self.runner.run(self.counters.check(key_id, key, team, budgets, reserve=reserve))

    def close(self) -> None:
        self.counters.close()
        self.runner.close()


def machine(folder: Path, url: str, errors: list[int] | None = None, **options: Any) -> Machine:
    return Machine(folder, url, errors, **options)


def key(ident: str = "k1", team_id: int | None = None, **limited: Any) -> limits.Limits:
    fields = dict(rpm=None, tpm=None, max_parallel=None, tokens_per_day=None,
                  tokens_per_month=None, models=(), weight=1)  # fmt: skip
    fields.update(limited)
    return limits_of(**fields, team_id=team_id, ident=ident)


# -- the store, two machines in one test process --------------------------------------------


def test_two_machines_share_one_requests_per_minute_exactly(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    one = machine(tmp_path / "one", redis_server.url)
    two = machine(tmp_path / "two", redis_server.url)
    try:
        limited = key(rpm=5)
        decisions = [
            (one if n % 2 else two).admit(1, limited, None, no_budgets()) for n in range(12)
        ]
        admitted = [d for d in decisions if isinstance(d, limits.Admission)]
        refused = [d for d in decisions if isinstance(d, limits.OverLimit)]
        assert len(admitted) == 5
        assert {r.limit for r in refused} == {"rpm"}
        assert refused[0].used == 5  # the count over both machines, not one's
        # The headers speak of both machines' requests.
        assert dict(admitted[-1].headers)["x-ratelimit-remaining-requests"] == "0"
        # Each machine alone would have let 5 through.
        assert sum(isinstance(d, limits.Admission) for d in decisions[::2]) < 5
    finally:
        one.close()
        two.close()


def test_in_flight_over_two_machines_is_given_back_when_requests_end(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    one = machine(tmp_path / "one", redis_server.url)
    two = machine(tmp_path / "two", redis_server.url)
    try:
        limited = key(max_parallel=2, tpm=100)
        first = one.admit(1, limited, None, no_budgets())
        second = two.admit(1, limited, None, no_budgets())
        assert isinstance(first, limits.Admission) and isinstance(second, limits.Admission)
        third = two.admit(1, limited, None, no_budgets())
        assert isinstance(third, limits.OverLimit) and third.limit == "max_parallel"
        assert third.used == 2
        first.release(150)  # written by the next flush, off the request's path
        assert one.remote is not None
        one.remote.flush()
        # The tokens of the request that ended count on the other machine too.
        after = two.admit(1, limited, None, no_budgets())
        assert isinstance(after, limits.OverLimit) and after.limit == "tpm"
        assert after.used == 150
        assert limits.live_use  # the web's reading is tested below
    finally:
        one.close()
        two.close()


def test_tokens_reserved_on_one_machine_hold_the_limit_on_the_other(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    one = machine(tmp_path / "one", redis_server.url)
    two = machine(tmp_path / "two", redis_server.url)
    try:
        limited = key(tpm=100)
        first = one.admit(1, limited, None, no_budgets(), reserve=60)
        second = two.admit(1, limited, None, no_budgets(), reserve=60)
        assert isinstance(first, limits.Admission) and isinstance(second, limits.Admission)
        refused = two.admit(1, limited, None, no_budgets(), reserve=60)
        assert isinstance(refused, limits.OverLimit)
        assert (refused.limit, refused.used, refused.reserved) == ("tpm", 0, 120)
        first.release(10)  # it used 10 of its 60
        one.remote.flush()
        again = two.admit(1, limited, None, no_budgets(), reserve=60)
        assert isinstance(again, limits.Admission)  # 10 used, 60 reserved on machine two
        for admitted in (second, again):
            admitted.release(0)
        two.remote.flush()
        client = redis.Redis.from_url(redis_server.url)
        fields = client.hgetall(redislimits.KEY_PREFIX + "k1")
        held = client.hgetall(redislimits.RESERVED_PREFIX + "k1")
        client.close()
        assert not [name for name in fields if name.startswith(b"f:")]  # all given back
        assert not held
    finally:
        one.close()
        two.close()


def test_the_urls_password_and_database_are_used_and_lost_scripts_sent_again(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("requirepass", "s3cret")
    client.close()
    url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/3"
    errors: list[int] = []
    one = machine(tmp_path / "one", url, errors)
    try:
        limited = key(rpm=10)
        assert isinstance(one.admit(1, limited, None, no_budgets()), limits.Admission)
        database = redis.Redis.from_url(url)
        assert database.exists(redislimits.KEY_PREFIX + "k1")
        # Redis loses its scripts (SCRIPT FLUSH, or a failover to a replica without them):
        # the admission sends it again, and is counted as ever.
        database.script_flush()
        second = one.admit(1, limited, None, no_budgets())
        assert isinstance(second, limits.Admission) and not second.fallback
        assert dict(second.headers)["x-ratelimit-remaining-requests"] == "8"
        database.close()
        assert errors == []
    finally:
        one.close()


def test_a_team_counts_its_keys_on_every_machine_together(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    one = machine(tmp_path / "one", redis_server.url)
    two = machine(tmp_path / "two", redis_server.url)
    try:
        team = key("t7-1", rpm=3)
        alice, bob = key("ka", team_id=7), key("kb", team_id=7)
        statuses = [
            isinstance(counters.admit(kid, k, team, no_budgets()), limits.Admission)
            for counters, kid, k in ((one, 1, alice), (two, 2, bob), (two, 1, alice),
                                     (one, 2, bob), (two, 2, bob))
        ]  # fmt: skip
        assert statuses == [True, True, True, False, False]
    finally:
        one.close()
        two.close()


def test_a_dead_machines_requests_stop_counting_in_flight_when_its_name_expires(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    import redis

    one = machine(tmp_path / "one", redis_server.url)
    two = machine(tmp_path / "two", redis_server.url)
    try:
        limited = key(max_parallel=1)
        held = one.admit(1, limited, None, no_budgets())
        assert isinstance(held, limits.Admission)
        assert isinstance(two.admit(1, limited, None, no_budgets()), limits.OverLimit)
        # Machine one dies without ending its request: its name is not renewed and expires.
        assert one.remote is not None
        client = redis.Redis.from_url(redis_server.url)
        client.delete(redislimits.HOLDER_PREFIX + one.remote.holder)
        client.close()
        assert isinstance(two.admit(1, limited, None, no_budgets()), limits.Admission)
    finally:
        one.close()
        two.close()


def test_with_redis_down_each_machine_counts_alone_and_comes_back(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redislimits, "DOWN_SECONDS", 0.5)
    errors: list[int] = []
    one = machine(tmp_path / "one", redis_server.url, errors)
    two = machine(tmp_path / "two", redis_server.url, errors)
    try:
        limited = key(rpm=4)
        for counters in (one, two, one):
            assert isinstance(counters.admit(1, limited, None, no_budgets()), limits.Admission)
        redis_server.stop()
        began = time.monotonic()
        # Down: a machine decides by its own counts at once, never a 500, never a long wait.
        alone = [two.admit(1, limited, None, no_budgets()) for _ in range(4)]
        assert time.monotonic() - began < 2
        assert [isinstance(d, limits.Admission) for d in alone] == [True, True, True, False]
        assert len(errors) >= 1  # counted (llmgw_gateway_limits_redis_errors_total)
        redis_server.start()  # empty: what it counted is gone with it
        # Once its pause after a failure (DOWN_SECONDS) is over, machine one counts in Redis
        # again: a probe of no limits (another ident, k1's counts untouched) is counted there.
        remote = one.remote
        wait_for(
            lambda: one.runner.run(remote.admit([("probe", None, None, None, 0)], 0)) is not None,
            timeout=redislimits.DOWN_SECONDS + 1,
            what="machine one counting in Redis again",
        )
        back = one.admit(1, limited, None, no_budgets())
        assert isinstance(back, limits.Admission)
        assert one.runner.run(remote.admit([("k1", None, 4, None, 0)], 0))
    finally:
        one.close()
        two.close()


def test_live_use_reads_every_machines_counts_from_redis(
    tmp_path: Path, redis_server: RedisServer, settings: Any
) -> None:
    from types import SimpleNamespace

    settings.LLMGW_LIMITS_REDIS = redis_server.url
    one = machine(tmp_path / "one", redis_server.url)
    two = machine(tmp_path / "two", redis_server.url)
    try:
        row = SimpleNamespace(id=1, key_hash="ab" * 32)
        limited = key(limits.key_ident(row.key_hash), rpm=100)
        first = one.admit(1, limited, None, no_budgets())
        assert isinstance(first, limits.Admission)
        assert isinstance(two.admit(1, limited, None, no_budgets()), limits.Admission)
        first.release(40)
        assert one.remote is not None
        one.remote.flush()
        use = limits.live_use(keys=[row], folder=tmp_path / "nowhere")
        assert use[("key", 1)] == limits.LiveUse(
            in_flight=1, requests_last_minute=2, tokens_last_minute=40
        )
    finally:
        one.close()
        two.close()


def test_the_queue_of_ended_requests_stays_at_its_cap_while_redis_cannot_be_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ten times as many ends as the queue holds, none written: the queue stays at
    MAX_PENDING, the excess is counted as dropped, and the memory held does not grow. The cap is
    a tenth of the gateway's here (10,000, not 100,000), which keeps the test to seconds: the
    bound is one comparison with it, whatever its value."""
    from gateway import metrics

    monkeypatch.setattr(redislimits, "DOWN_SECONDS", 3600.0)  # the writer does not try again
    monkeypatch.setattr(redislimits, "MAX_PENDING", 10_000)
    board = metrics.metrics()
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # refused at once
    remote = RedisLimits(nobody, on_drop=board.limits_redis_dropped.inc)
    ended = redislimits.Decided(counted=(), admitted=True, idents=("k1",), bucket=0)
    cap = redislimits.MAX_PENDING
    tracemalloc.start()
    try:
        # Token counts past the small ints that Python shares: each end holds objects of its own.
        for tokens in range(1000, 1000 + cap):
            remote.end(ended, tokens, 0)
        at_cap = tracemalloc.get_traced_memory()[0]
        for tokens in range(1000 + cap, 1000 + 10 * cap):
            remote.end(ended, tokens, 0)
        past_cap = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        remote.close()
    assert remote.pending == cap
    assert remote._pending[0][2] == 1000 + 9 * cap  # the oldest went
    dropped = board.registry.get_sample_value("llmgw_gateway_limits_redis_dropped_total")
    assert dropped == 9 * cap
    assert at_cap > 50 * cap  # what is measured is the queue: about 100 bytes an end
    assert past_cap < at_cap * 1.01, (at_cap, past_cap)


# -- two gateway machines, as the run command starts them ------------------------------------


@pytest.mark.parametrize("store", ["redis", "off"])
def test_rpm_over_two_gateway_machines(
    tmp_path: Path, engine: FakeEngine, redis_server: RedisServer, store: str
) -> None:
    """Through Redis, two machines let exactly the limit through; each counting alone (Redis
    off, or down), each lets the whole limit through: the overshoot the README states."""
    from tests.support.system import System

    system = System(tmp_path / "system")
    try:
        secret, _ = limited_key(system, engine.port, rpm=10)
        envs = [
            {
                **system.env,
                "LLMGW_VAR_DIR": str(tmp_path / f"machine-{index}"),
                "LLMGW_LIMITS_REDIS": redis_server.url if store == "redis" else "off",
            }
            for index in range(2)
        ]
        urls = start_gateways(system, secret, envs)
        statuses = ask_in_turn(urls, secret)
        assert statuses.count(200) + statuses.count(429) == 40, statuses
        assert statuses.count(200) == (10 if store == "redis" else 20), statuses
        scraped = requests.get(f"{urls[0]}/metrics", timeout=5).text
        assert "llmgw_gateway_limits_redis_errors_total 0.0" in scraped or store == "off"
        # The ends waiting to be written to Redis: each is written at the next flush (every
        # 50 ms), so none is left once the last request has had its flush.
        wait_for(
            lambda: (
                "llmgw_gateway_limits_redis_pending_entries 0.0"
                in requests.get(f"{urls[0]}/metrics", timeout=5).text
            ),
            timeout=10,
            what="every end written to Redis",
        )
    finally:
        system.close()

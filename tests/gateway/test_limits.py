"""Keys' and teams' limits through the real gateway: rates, in flight, budgets, expiry, models."""

from __future__ import annotations

import json
import os
import time
import zlib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from access.models import GatewayKey, KeyUsageDay, Team, hash_key
from gateway import boards, limits
from gateway.limits import Limits, SharedCounters, limits_of
from tests.gateway.fake_engine import FakeEngine
from tests.support.waiting import wait_for

ASK = {"model": "chat", "prompt": "hi"}  # the fake engine answers it with 3 + 5 tokens

pytestmark = pytest.mark.usefixtures("limit_counters")


@pytest.fixture
def chat(catalog: Any, engine: FakeEngine) -> FakeEngine:
    catalog.add("chat")
    catalog.replica("chat", engine)
    return engine


def limit(secret: str, **fields: Any) -> GatewayKey:
    """Set a key's limits as a row (the services that set them are tested on their own)."""
    GatewayKey.objects.filter(key_hash=hash_key(secret)).update(**fields)
    return GatewayKey.objects.get(key_hash=hash_key(secret))


def in_flight(counters: SharedCounters, key: GatewayKey) -> int:
    use = counters._use(limits.key_tag(key.pk), int(time.time() // 5), 0, 0)
    return use.in_flight


# -- rates ------------------------------------------------------------------------------------


def test_it_refuses_past_a_keys_requests_per_minute_as_openai_does(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    limit(keys["alice"], rpm=2)
    first = gw.post("/v1/completions", ASK)
    second = gw.post("/v1/completions", ASK)
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert second.headers["x-ratelimit-reset-requests"].endswith("s")

    refused = gw.post("/v1/completions", ASK)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "requests",
        "rate_limit_exceeded",
        None,
    )
    wait = int(refused.headers["Retry-After"])
    assert 55 <= wait <= 65
    assert error["message"] == (
        "This key's limit of 2 requests per minute is reached (2 requests in the last minute); "
        f"try again in {wait}s."
    )
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(chat.requests) == 2  # the third reached no replica
    # Answers before the limits are checked say where they stand too.
    for answer in (
        gw.post("/v1/completions", "not json"),
        gw.post("/v1/completions", {**ASK, "model": "nosuch"}),
    ):
        assert answer.status_code in (400, 404)
        assert answer.headers["x-ratelimit-limit-requests"] == "2"
        assert answer.headers["x-ratelimit-remaining-requests"] == "0"
    scraped = gw.get("/metrics").text
    assert 'llmgw_gateway_limited_total{limit="rpm",subject="key"} 1.0' in scraped
    assert "llmgw_gateway_limit_slots_held 1.0" in scraped
    assert "llmgw_gateway_keys_limited" in scraped


def test_an_unlimited_keys_answers_are_unchanged(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    limit(keys["alice"], rpm=1)
    for _ in range(3):
        answer = gw.post("/v1/completions", ASK, key=keys["bob"])
        assert answer.status_code == 200
        assert not [h for h in answer.headers if h.lower().startswith("x-ratelimit")]


def test_a_teams_requests_per_minute_count_all_its_keys_together(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    team = Team.objects.create(name="ml", rpm=3)
    limit(keys["alice"], team=team)
    limit(keys["bob"], team=team)
    statuses = [
        gw.post("/v1/completions", ASK, key=keys[name]).status_code
        for name in ("alice", "bob", "alice")
    ]
    assert statuses == [200, 200, 200]
    refused = gw.post("/v1/completions", ASK, key=keys["bob"])
    assert refused.status_code == 429
    assert refused.json()["error"]["message"].startswith(
        "Its team ml's limit of 3 requests per minute is reached (3 requests in the last minute)"
    )
    assert gw.post("/v1/completions", ASK, key=keys["carol"]).status_code == 200


def test_it_refuses_past_a_keys_tokens_per_minute(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    limit(keys["alice"], tpm=10)
    first = gw.post("/v1/completions", ASK)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "10"
    assert first.headers["x-ratelimit-remaining-tokens"] == "10"  # nothing counted before it
    # 8 tokens counted: below 10, so one more goes (and takes it over by its own 8).
    second = gw.post("/v1/completions", ASK)
    assert second.status_code == 200
    assert second.headers["x-ratelimit-remaining-tokens"] == "2"
    refused = gw.post("/v1/completions", ASK)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert (
        "This key's limit of 10 tokens per minute is reached (16 tokens in the last minute)"
        in (error["message"])
    )
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


# -- in flight --------------------------------------------------------------------------------


def test_requests_in_flight_are_limited_and_given_back_when_the_answer_ends(
    gw: Any, keys: dict[str, str], chat: FakeEngine, limit_counters: SharedCounters
) -> None:
    key = limit(keys["alice"], max_parallel=1)
    chat.delay, chat.events = 0.2, 5
    streaming = gw.post("/v1/completions", {**ASK, "stream": True}, stream=True)
    assert streaming.status_code == 200
    refused = gw.post("/v1/completions", ASK)
    assert refused.status_code == 429
    assert refused.json()["error"]["message"] == (
        "This key's limit of 1 request in flight at once is reached (1 in flight); send the "
        "next one when one of them ends."
    )
    assert refused.headers["Retry-After"] == "1"
    assert b"[DONE]" in b"".join(streaming.iter_content(chunk_size=None))
    given_back(limit_counters, key)
    assert gw.post("/v1/completions", ASK).status_code == 200


@pytest.mark.parametrize("ending", ["client gone", "engine error", "engine reset", "no replica"])
def test_in_flight_is_given_back_however_the_request_ends(
    ending: str,
    gw: Any,
    keys: dict[str, str],
    catalog: Any,
    chat: FakeEngine,
    limit_counters: SharedCounters,
) -> None:
    key = limit(keys["alice"], max_parallel=1)
    if ending == "client gone":
        chat.delay, chat.events = 0.3, 20
        streaming = gw.post("/v1/completions", {**ASK, "stream": True}, stream=True)
        assert streaming.status_code == 200
        # Held: a generator dropped would close the connection itself.
        chunks = streaming.iter_content(chunk_size=None)
        next(chunks)
        assert in_flight(limit_counters, key) == 1
        streaming.close()
    elif ending == "engine error":
        chat.mode = "error"
        assert gw.post("/v1/completions", ASK).status_code == 500
    elif ending == "engine reset":
        chat.mode = "reset"
        assert gw.post("/v1/completions", ASK).status_code == 502
    else:
        catalog.add("idle")
        assert gw.post("/v1/completions", {**ASK, "model": "idle"}).status_code == 503
    given_back(limit_counters, key)
    chat.mode = "ok"
    chat.delay = 0
    assert gw.post("/v1/completions", ASK).status_code == 200


def given_back(counters: SharedCounters, key: GatewayKey) -> None:
    """Waits for the key's in-flight count to be given back (it is once the request ends)."""
    wait_for(
        lambda: in_flight(counters, key) == 0,
        timeout=5,
        what="the key's in-flight count given back",
    )


# -- budgets ----------------------------------------------------------------------------------


def test_a_daily_budget_counts_the_database_and_what_was_counted_since_once(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    key = limit(keys["alice"], tokens_per_day=20)
    today = datetime.now(UTC).date()
    # Another gateway process (or this one's life before a restart) wrote 15 tokens today,
    # and 1,000 yesterday, which do not count.
    KeyUsageDay.objects.create(
        key=key, model="chat", day=today, writer="elsewhere", prompt_tokens=10, completion_tokens=5
    )
    KeyUsageDay.objects.create(
        key=key,
        model="chat",
        day=today - timedelta(days=1),
        writer="elsewhere",
        completion_tokens=1000,
    )
    assert gw.post("/v1/completions", ASK).status_code == 200  # 15 < 20; now 23
    refused = gw.post("/v1/completions", ASK)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert error["message"].startswith(
        "This key's budget of 20 tokens per day (UTC) is spent (23 used); it resets at "
    )
    assert "00:00:00 UTC, in " in error["message"]
    # This process's book has written its own 8 tokens meanwhile (gw.post flushes it): read
    # again, they count once, by what this process holds, not again by its row.
    assert KeyUsageDay.objects.filter(writer="test").get().completion_tokens == 5
    again = gw.post("/v1/completions", ASK)
    assert "(23 used)" in again.json()["error"]["message"]


def test_a_monthly_budget_survives_a_restart_through_the_database(
    gw: Any, keys: dict[str, str], chat: FakeEngine, tmp_path: Path, monkeypatch: Any
) -> None:
    key = limit(keys["alice"], tokens_per_month=30)
    first_of_month = datetime.now(UTC).date().replace(day=1)
    KeyUsageDay.objects.create(
        key=key, model="chat", day=first_of_month, writer="old", completion_tokens=20
    )
    assert gw.post("/v1/completions", ASK).status_code == 200  # 20 < 30; now 28, written
    # A restart: this process's counts are gone, its book's row stays; a new book writes anew.
    from access import traffic
    from tests.support.gateway_state import current_state

    monkeypatch.setattr(current_state(), "book", traffic.TrafficBook("next"))
    monkeypatch.setattr(
        current_state(), "counters", SharedCounters(tmp_path / "after", writer="next")
    )
    assert gw.post("/v1/completions", ASK).status_code == 200  # 28 < 30; now 36
    refused = gw.post("/v1/completions", ASK)
    assert refused.status_code == 429
    assert refused.json()["error"]["message"].startswith(
        "This key's budget of 30 tokens per month (UTC) is spent (36 used); it resets at "
    )
    current_state().counters.close()  # type: ignore[union-attr]


def test_a_teams_budget_counts_its_keys_together(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    team = Team.objects.create(name="ml", tokens_per_day=10)
    limit(keys["alice"], team=team)
    bob = limit(keys["bob"], team=team)
    KeyUsageDay.objects.create(
        key=bob, model="chat", day=datetime.now(UTC).date(), writer="w", completion_tokens=12
    )
    refused = gw.post("/v1/completions", ASK)
    assert refused.status_code == 429
    assert refused.json()["error"]["message"].startswith(
        "Its team ml's budget of 10 tokens per day (UTC) is spent (12 used)"
    )


# -- expiry and models ------------------------------------------------------------------------


def test_an_expired_key_gets_401_saying_when(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    expired = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    limit(keys["alice"], expires_at=expired)
    answer = gw.post("/v1/completions", ASK)
    assert answer.status_code == 401
    error = answer.json()["error"]
    assert error["code"] == "expired_api_key"
    assert error["message"].startswith(
        "This API key expired at 2026-01-02 03:04:05 UTC, so it opens nothing any more."
    )
    assert gw.get("/v1/models").status_code == 401
    limit(keys["alice"], expires_at=datetime.now(UTC) + timedelta(hours=1))
    assert gw.post("/v1/completions", ASK).status_code == 200


def test_a_key_limited_to_some_models_sees_only_those_and_others_do_not_exist(
    gw: Any, keys: dict[str, str], catalog: Any, engine: FakeEngine
) -> None:
    from catalog.models import Model

    for name in ("chat-a", "chat-b", "secret"):
        catalog.add(name)
        catalog.replica(name, engine)
    team = Team.objects.create(name="ml", models=["chat-*", "secret"])
    limit(keys["alice"], models=["chat-?", "sec*"], team=team)
    Team.objects.filter(pk=team.pk).update(models=["chat-a", "secret"])
    listed = [m["id"] for m in gw.get("/v1/models").json()["data"]]
    assert listed == ["chat-a", "secret"]
    assert gw.post("/v1/completions", {**ASK, "model": "chat-a"}).status_code == 200

    hidden = gw.post("/v1/completions", {**ASK, "model": "chat-b"})
    Model.objects.filter(name="chat-b").delete()
    unknown = gw.post("/v1/completions", {**ASK, "model": "chat-b"})
    assert hidden.status_code == unknown.status_code == 404
    # The same but for each request's own ID.
    hidden_error, unknown_error = hidden.json()["error"], unknown.json()["error"]
    assert hidden_error.pop("request_id") != unknown_error.pop("request_id")
    assert hidden_error == unknown_error
    assert "chat-b" not in hidden.json()["error"]["message"].split("closest first")[-1]
    mine = {"date", "x-request-id"}
    assert {k: v for k, v in hidden.headers.items() if k.lower() not in mine} == {
        k: v for k, v in unknown.headers.items() if k.lower() not in mine
    }


# -- clients ----------------------------------------------------------------------------------


def test_the_openai_client_sees_rate_limit_error(
    gw: Any, keys: dict[str, str], chat: FakeEngine
) -> None:
    import openai

    limit(keys["alice"], rpm=1)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=keys["alice"], max_retries=0)
    from tests.support.gateway_state import current_state

    current_state().reload()
    usage = client.completions.create(model="chat", prompt="hi").usage
    assert usage is not None and usage.total_tokens == 8
    with pytest.raises(openai.RateLimitError) as raised:
        client.completions.create(model="chat", prompt="hi")
    assert raised.value.status_code == 429
    assert raised.value.code == "rate_limit_exceeded"
    assert int(raised.value.response.headers["retry-after"]) >= 55


# -- the counters themselves ------------------------------------------------------------------


def test_two_processes_files_count_together_and_a_dead_ones_are_dropped(tmp_path: Path) -> None:
    folder = tmp_path / "gateway-limits"
    key = limits_of(
        rpm=3, tpm=None, max_parallel=2, tokens_per_day=None, tokens_per_month=None,
        models=[], weight=1,
    )  # fmt: skip
    budgets = limits.no_budgets()
    mine = SharedCounters(folder, writer="a")
    # Another live process of this machine: the test's parent stands in for it.
    other = SharedCounters(folder, pid=os.getppid(), writer="b")
    try:
        held = other.admit(7, key, None, budgets)
        assert isinstance(held, limits.Admission)
        own = mine.admit(7, key, None, budgets)
        assert isinstance(own, limits.Admission)
        refused = mine.admit(7, key, None, budgets)
        assert isinstance(refused, limits.OverLimit)
        assert (refused.limit, refused.used) == ("max_parallel", 2)
        other.release(held, 40)
        mine.release(own, 0)
        assert isinstance(mine.admit(7, key, None, budgets), limits.Admission)
        refused = mine.admit(7, key, None, budgets)
        assert isinstance(refused, limits.OverLimit)
        assert (refused.limit, refused.used) == ("rpm", 3)
        assert sorted(mine.writers()) == ["a", "b"]
    finally:
        other.close()
    # A process gone takes its file, and its counts, with it; so does one whose pid now names
    # another process (its start time differs).
    dead = SharedCounters(folder, pid=_dead_pid(), writer="c")
    assert isinstance(dead.admit(8, key, None, budgets), limits.Admission)
    reused = SharedCounters(folder, pid=os.getppid(), writer="d")
    assert isinstance(reused.admit(8, key, None, budgets), limits.Admission)
    with reused.board.path.open("r+b") as board:  # its board says it started at another time
        magic, layout, pid, started, beat = boards.HEADER.unpack(board.read(boards.HEADER.size))
        board.seek(0)
        board.write(boards.HEADER.pack(magic, layout, pid, started + 1, beat))
    mine.board.scanned_at = float("-inf")
    assert mine.writers() == ["a"]
    assert isinstance(mine.admit(8, key, None, budgets), limits.Admission)
    assert isinstance(mine.admit(8, key, None, budgets), limits.Admission)  # only its own count
    assert sorted(p.name for p in folder.glob(f"{limits.FILE_PREFIX}-*")) == [
        f"{limits.FILE_PREFIX}-{os.getpid()}"
    ]
    for counters in (dead, reused, mine):
        counters.close()


def test_ten_times_more_keys_than_slots_leave_the_slots_and_memory_flat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slots run out. With every slot held by a key in flight, the next key is refused
    (503 limits_full, OpenAI's error body), while a key that holds a slot goes on. Then ten
    times as many keys as there are slots, each used once, a wave every 70 s: each takes the
    slot of a key idle since the wave before (the oldest go), none is refused, and neither the
    slots held nor the memory grow. The slots are 256 here, not 32,768, which keeps the test to
    a second: the bound is the table's size, whatever its value."""
    import tracemalloc

    from gateway import errors

    monkeypatch.setattr(limits, "SLOTS", 256)
    bound = limits.SLOTS
    key = limits_of(
        rpm=1000, tpm=None, max_parallel=None, tokens_per_day=None, tokens_per_month=None,
        models=[], weight=1,
    )  # fmt: skip
    budgets = limits.no_budgets()
    counters = SharedCounters(tmp_path / "gateway-limits", writer="a")
    now = 1_800_000_000.0
    try:
        # Every slot held by a request in flight: the next key is refused, saying why.
        held = []
        for key_id in range(1, 2 * bound):
            admitted = counters.admit(key_id, key, None, budgets, now=now)
            if isinstance(admitted, limits.OverLimit):
                break
            held.append(admitted)
        assert counters.held() == len(held) <= bound
        assert len(held) > bound * 0.9  # the probing fills nearly every slot first
        refused = counters.admit(10 * bound, key, None, budgets, now=now)
        assert isinstance(refused, limits.OverLimit)
        assert (refused.limit, refused.figure) == ("slots", bound)
        answer = errors.limits_full(refused.figure)
        assert answer.status == 503 and answer.headers["Retry-After"] == "1"
        assert answer.json()["error"]["code"] == "limits_full"  # type: ignore[index]
        assert isinstance(counters.admit(1, key, None, budgets, now=now), limits.Admission)
        for admission in held:
            counters.release(admission, 0, now=now)

        # Ten times the slots in keys, half the slots a wave, a wave every 70 s (a key is idle
        # 65 s after its last request): each wave takes the slots of the one before.
        waves = 20
        first = 1_000_000
        sizes, memory = [0] * waves, [0] * waves  # held, and memory, after each wave
        tracemalloc.start()
        try:
            for wave in range(waves):
                now += 70
                for index in range(bound // 2):
                    key_id = first + wave * bound + index
                    admitted = counters.admit(key_id, key, None, budgets, now=now)
                    assert isinstance(admitted, limits.Admission), (wave, index, admitted)
                    counters.release(admitted, 0, now=now)
                sizes[wave] = counters.held()
                memory[wave] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert max(sizes) <= bound
        # From the second wave on, every slot a wave takes was another key's.
        at_bound = memory[1]
        assert 50 * bound < at_bound  # what is measured holds the slots' keys
        assert max(memory[2:]) < at_bound * 1.1, (at_bound, memory)
        # The oldest keys' slots went to the newest; the newest hold theirs.
        assert limits.key_tag(first) not in counters._slots
        assert limits.key_tag(first + (waves - 1) * bound) in counters._slots
        # The file never grows.
        assert os.path.getsize(counters.board.path) == boards.HEADER_BYTES + limits.BOARD_BYTES
    finally:
        counters.close()


def _dead_pid() -> int:
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_budget_counts_each_writer_once() -> None:
    today = datetime.now(UTC).date()
    budgets = limits.Budgets(
        day=today,
        month=today.replace(day=1),
        by_subject={2: limits.Base(day=50, month=80, by_writer={"here": (10, 20)})},
    )
    # "here" (a live local process) holds 14 today, 24 this month: 4 more than its rows.
    assert budgets.used(2, {"here": (14, 24)}, today) == (54, 84)
    # A local process started after the read has no rows in the base.
    assert budgets.used(2, {"here": (14, 24), "new": (3, 3)}, today) == (57, 87)
    # A new day: yesterday's figures are not today's.
    assert budgets.used(2, {}, today + timedelta(days=1))[0] == 0


def test_limits_read_both_databases_forms() -> None:
    read = limits_of(
        rpm=None, tpm=None, max_parallel=None, tokens_per_day=None, tokens_per_month=None,
        models='["chat-*", "x"]', weight=None, expires_at="2026-01-02 03:04:05.000000",
    )  # fmt: skip
    assert read.allows("chat-a") and read.allows("x") and not read.allows("xy")
    assert not read.allows("other")
    assert read.expires_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    assert Limits().allows("anything")
    assert limits.reset_text(0.25) == "250ms"
    assert limits.reset_text(61) == "1m1s"


# -- two gateway worker processes -------------------------------------------------------------


def test_rpm_holds_across_two_gateway_processes_of_one_machine(
    tmp_path: Path, engine: FakeEngine
) -> None:
    from tests.support.gateway_processes import ask_in_turn, limited_key, start_gateways
    from tests.support.system import System

    system = System(tmp_path / "system")
    try:
        secret, key_id = limited_key(system, engine.port, rpm=10)
        # Two gateway processes of one machine, as uvicorn's workers are (the same folder for
        # their shared counts, the same database).
        urls = start_gateways(system, secret)
        statuses = ask_in_turn(urls, secret)
        assert statuses.count(200) + statuses.count(429) == 40
        assert statuses.count(200) == 10, statuses
        # Each process admitted some of them: the limit held across the two, not within one.
        folder = tmp_path / "system" / "var" / "gateway-limits"
        files = sorted(folder.glob(f"{limits.FILE_PREFIX}-*"))
        assert len(files) == 2
        counted = []
        tag = limits.key_tag(key_id)
        with limits._boards_in(folder) as found:
            for view in (other.body for other in found):
                base = limits._find(view, tag, zlib.crc32(tag.to_bytes(8, "little")) % limits.SLOTS)
                counted.append(
                    0 if base is None else sum(view[base + limits.REQUESTS + i] for i in range(13))
                )
        assert sum(counted) == 10
        assert all(counted), f"one process took every request: {counted}"
    finally:
        system.close()


# -- reservations: what requests in flight may still use ---------------------------------------


def tokens_limited(**fields: Any) -> Limits:
    figures = dict(rpm=None, tpm=None, max_parallel=None, tokens_per_day=None,
                   tokens_per_month=None, models=[], weight=1)  # fmt: skip
    return limits_of(**{**figures, **fields})


def test_a_request_reserves_its_prompt_at_most_and_each_answers_most() -> None:
    def reserved(body: dict[str, Any], *limit: str) -> int:
        raw = json.dumps(body).encode()
        given = limit or ("max_completion_tokens", "max_tokens")
        return limits.reservation(raw, body, 2048, given) - len(raw) - limits.TEMPLATE_TOKENS

    assert reserved({"model": "chat", "prompt": "hi", "max_tokens": 16}) == 16
    assert reserved({"model": "chat", "prompt": "hi", "max_tokens": 16, "n": 3}) == 48
    assert reserved({"model": "chat", "prompt": ["a", "b"], "max_tokens": 16}) == 32
    chat = {"model": "chat", "messages": [], "max_tokens": 99, "max_completion_tokens": 10}
    assert reserved(chat) == 10
    # No max_tokens: what the engine would generate, the model's context; never more.
    assert reserved({"model": "chat", "prompt": "hi"}) == 2048
    assert reserved({"model": "chat", "prompt": "hi", "max_tokens": 10**6}) == 2048
    # An endpoint that generates nothing (embeddings, a count) reserves its prompt alone.
    assert limits.reservation(b"{}", {"input": "hi", "max_tokens": 9}, 2048, ()) == (
        2 + limits.TEMPLATE_TOKENS
    )
    # Each API's own field: the Responses API's max_output_tokens.
    assert (
        reserved({"model": "chat", "input": "hi", "max_output_tokens": 7}, "max_output_tokens") == 7
    )
    assert reserved({"model": "chat", "input": "hi", "max_tokens": 7}, "max_output_tokens") == 2048


def test_requests_in_flight_hold_what_they_reserve_against_tokens_per_minute(
    tmp_path: Path,
) -> None:
    counters = SharedCounters(tmp_path / "gateway-limits", writer="a")
    key = tokens_limited(tpm=100)
    budgets = limits.no_budgets()
    try:
        first = counters.admit(1, key, None, budgets, reserve=60)
        second = counters.admit(1, key, None, budgets, reserve=60)
        assert isinstance(first, limits.Admission) and isinstance(second, limits.Admission)
        # Nothing used yet, 120 reserved: the limit is held by the two in flight.
        assert dict(second.headers)["x-ratelimit-remaining-tokens"] == "40"
        refused = counters.admit(1, key, None, budgets, reserve=60)
        assert isinstance(refused, limits.OverLimit)
        assert (refused.limit, refused.used, refused.reserved) == ("tpm", 0, 120)
        assert refused.retry_after == 1.0  # when one of them ends
        first.release(10)  # it used 10 of its 60
        again = counters.admit(1, key, None, budgets, reserve=60)
        assert isinstance(again, limits.Admission)  # 10 used and 60 reserved: below 100
        second.release(50)
        again.release(50)
        refused = counters.admit(1, key, None, budgets, reserve=60)
        assert isinstance(refused, limits.OverLimit)
        assert (refused.used, refused.reserved) == (110, 0)
        assert refused.retry_after > 1  # until the tokens leave the window
    finally:
        counters.close()


def test_a_budget_counts_what_requests_in_flight_reserve(tmp_path: Path) -> None:
    from gateway import errors

    counters = SharedCounters(tmp_path / "gateway-limits", writer="a")
    key = tokens_limited(tokens_per_day=100)
    budgets = limits.no_budgets()
    try:
        held = counters.admit(1, key, None, budgets, reserve=150)
        assert isinstance(held, limits.Admission)  # nothing used or held before it
        refused = counters.admit(1, key, None, budgets, reserve=10)
        assert isinstance(refused, limits.OverLimit)
        assert (refused.limit, refused.used, refused.reserved) == ("tokens_per_day", 0, 150)
        said = errors.limited(
            refused.limit, team=None, figure=refused.figure, used=refused.used,
            retry_after=refused.retry_after, resets_at="", headers={}, reserved=refused.reserved,
        )  # fmt: skip
        error = said.json()["error"]
        assert error["message"] == (
            "This key's budget of 100 tokens per day (UTC) is held by requests in flight (0 "
            "used today, 150 more reserved by the requests in flight for what they may still "
            "use); send the next one when one of them ends."
        )
        assert (error["code"], said.headers["Retry-After"]) == ("rate_limit_exceeded", "1")
        held.release(30)
        assert isinstance(counters.admit(1, key, None, budgets, reserve=10), limits.Admission)
    finally:
        counters.close()


def test_near_a_token_limit_the_check_takes_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With another process counting, a request goes without the lock only while the tokens
    used and reserved leave room for its reservation and one more per other process (what they
    may be admitting unseen); nearer, the lock decides, and the limit is passed by one
    reservation at most."""
    folder = tmp_path / "gateway-limits"
    key = tokens_limited(tpm=100)
    budgets = limits.no_budgets()
    mine = SharedCounters(folder, writer="a")
    other = SharedCounters(folder, pid=os.getppid(), writer="b")
    locked: list[int] = []
    decisions: list[object] = []
    real_flock = limits.fcntl.flock

    def flock(handle: int, operation: int) -> None:
        if operation == limits.fcntl.LOCK_EX:
            locked.append(len(decisions))
        real_flock(handle, operation)

    monkeypatch.setattr(limits.fcntl, "flock", flock)
    try:
        assert isinstance(other.admit(1, key, None, budgets, reserve=20), limits.Admission)
        mine.admit(2, key, None, budgets)  # reads the folder (under the lock)
        locked.clear()
        for _ in range(5):
            decisions.append(mine.admit(1, key, None, budgets, reserve=20))
        # At 20, 40 and 60 held there is room for this one's 20 and the other process's; at
        # 80 the lock decides (below 100: let through, and 120 are held); at 120, refused,
        # which needs no lock.
        assert [isinstance(d, limits.Admission) for d in decisions] == [True] * 4 + [False]
        assert locked == [3]
    finally:
        other.close()
        mine.close()

"""Prefix-cache-aware routing: prompt block hashes, the shared table, and the balancer's choice."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from gateway import prefix
from gateway.prefix import BLOCK_CHARS, SLACK, PrefixTable, block_hashes, prompt_text
from gateway.routing import Balancer, Candidate
from tests.support.waiting import wait_for

pytestmark = pytest.mark.smoke

SYSTEM = "You are a careful assistant. " * 60  # about 1,700 characters


def chat(*turns: str) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}]
    for index, text in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return {"model": "chat", "messages": messages}


def hashes(body: dict[str, object], engine: str = "chat") -> list[int]:
    return block_hashes(prompt_text(body), engine)


def test_equal_beginnings_give_equal_leading_hashes() -> None:
    first = hashes(chat("What is a llama?"))
    later = hashes(chat("What is a llama?", "An animal.", "Where do they live?"))
    shared = len(prompt_text(chat("What is a llama?"))) // BLOCK_CHARS
    assert first[:shared] == later[:shared]
    assert len(later) > len(first)
    other = hashes(chat("Tell me about whales."))
    assert other[: len(SYSTEM) // BLOCK_CHARS] == first[: len(SYSTEM) // BLOCK_CHARS]
    assert other[-1] != first[-1]
    # Another engine name (another model or adapter) never shares a cache.
    assert hashes(chat("What is a llama?"), engine="chat-sql")[0] != first[0]


def test_prompt_text_reads_completions_and_content_parts() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(parts) == "user\x00hi\x00"
    assert prompt_text({"messages": "nonsense"}) == ""
    assert block_hashes("", "chat") == []


def test_the_table_finds_the_longest_remembered_beginning() -> None:
    table = PrefixTable(None)
    short, long = hashes(chat("a" * 10)), hashes(chat("a" * 10, "b" * 600, "c" * 600))
    table.remember(short, "r1", now=1000)
    table.remember(long, "r2", now=1001)
    assert table.longest(long, ["r1", "r2"], now=1002) == ("r2", len(long))
    # A beginning remembers the last replica it was sent to: r2 took over the whole blocks they
    # share; the short prompt's own last (partial) block is still r1's.
    assert table.longest(short, ["r1", "r2"], now=1002) == ("r1", len(short))
    assert table.longest(short[:-1], ["r1", "r2"], now=1002) == ("r2", len(short) - 1)
    # Only candidates count: without r2, nothing that r2 took over is offered.
    assert table.longest(long, ["r1"], now=1002) is None
    other = hashes(chat("z" * 600))
    table.remember(other, "r1", now=1002)
    found = table.longest(long, ["r1"], now=1003)
    assert found is not None and found[0] == "r1" and found[1] == len(SYSTEM) // BLOCK_CHARS
    # Old choices are forgotten.
    assert table.longest(long, ["r1", "r2"], now=1002 + prefix.TTL_SECONDS + 10) is None


def test_gateway_processes_share_the_table(tmp_path: Path) -> None:
    one, two = PrefixTable(tmp_path), PrefixTable(tmp_path)
    body = hashes(chat("hello"))
    one.remember(body, "r7")
    assert two.longest(body, ["r6", "r7"]) == ("r7", len(body))
    one.close()
    two.close()


def test_ten_times_the_tables_entries_leave_its_size_and_memory_flat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table is fixed: ten times as many prefixes as it has entries fill it and then
    overwrite it, its entries in use never past TABLE_ENTRIES, its file never larger, and no
    memory held for them. The table is 1,024 entries here, not 65,536, which keeps the test
    short: the bound is the table's size, whatever its value."""
    import tracemalloc

    monkeypatch.setattr(prefix, "TABLE_ENTRIES", 1024)
    bound = prefix.TABLE_ENTRIES
    table = PrefixTable(tmp_path)
    sizes = []
    try:
        tracemalloc.start()
        try:
            for batch in range(10):
                # A batch: as many new prefixes as the table has entries, 16 blocks each.
                for prompt in range(bound // 16):
                    first = (batch * bound + prompt * 16) * 7919 + 1
                    table.remember(range(first, first + 16), f"r{prompt % 4}", now=1000)
                sizes.append(table.size())
                if batch == 0:
                    at_bound = tracemalloc.get_traced_memory()[0]
            past_bound = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert max(sizes) <= bound
        assert sizes[-1] > bound // 2  # in use: filled, then overwritten
        assert past_bound < at_bound + 4096, (at_bound, past_bound)
        assert (tmp_path / "prefixes").stat().st_size == bound * 16
        # The newest are found; whatever they overwrote is not.
        newest = (9 * bound + 15 * 16) * 7919 + 1
        assert table.longest(range(newest, newest + 16), ["r3"], now=1001) == ("r3", 16)
    finally:
        table.close()


def candidates(slots: int = 4) -> list[Candidate]:
    return [
        Candidate(
            id=f"r{i}", model="chat", state="ready", address="127.0.0.1", port=9000 + i, slots=slots
        )
        for i in (1, 2)
    ]


def test_a_conversation_stays_on_the_replica_that_has_its_beginning() -> None:
    balancer = Balancer()
    replicas = candidates()
    turns = ["first question"]
    first = balancer.choose(replicas, "chat", hashes(chat(*turns)))
    balancer.release(first)
    for step in range(5):
        turns += [f"answer {step}", f"question {step}"]
        chosen = balancer.choose(replicas, "chat", hashes(chat(*turns)))
        balancer.release(chosen)
        assert chosen.id == first.id


def test_the_cached_replica_is_taken_while_it_has_a_free_slot() -> None:
    balancer = Balancer()
    replicas = candidates(slots=2)
    body = hashes(chat("question"))
    home = balancer.choose(replicas, "chat", body)
    # One slot of two busy, the other replica idle: the cache wins.
    assert balancer.choose(replicas, "chat", body).id == home.id


def test_no_request_queues_on_a_full_replica_while_another_is_idle() -> None:
    balancer = Balancer()
    replicas = candidates(slots=1)
    body = hashes(chat("question"))
    home = balancer.choose(replicas, "chat", body)  # its only slot is busy now
    assert balancer.choose(replicas, "chat", body).id != home.id


def test_when_every_replica_is_full_the_cache_wins_within_the_slack() -> None:
    balancer = Balancer()
    replicas = candidates(slots=1)
    body = hashes(chat("question"))
    home = balancer.choose(replicas, "chat", body)
    other = next(c for c in replicas if c.id != home.id)
    balancer.load.add(other.id, 1)  # both full
    for _ in range(SLACK + 1):  # 0, 1, ... SLACK requests further behind when it is chosen
        assert balancer.choose(replicas, "chat", body).id == home.id
    # Now more than SLACK requests further behind than the other: the least loaded wins.
    assert balancer.choose(replicas, "chat", body).id == other.id


def test_without_a_prefix_the_least_loaded_is_chosen() -> None:
    balancer = Balancer()
    replicas = candidates(slots=1)
    balancer.load.add("r1", 3)
    assert balancer.choose(replicas, "chat").id == "r2"


def test_many_conversations_spread_over_both_replicas() -> None:
    balancer = Balancer()
    replicas = candidates(slots=4)
    counts = {"r1": 0, "r2": 0}
    chosen_for: dict[int, list[str]] = {}
    in_flight = []
    # 8 conversations sending a turn each at once, 10 rounds; a round's requests overlap.
    for round_ in range(10):
        for conversation in range(8):
            turns = [f"conversation {conversation} turn {t}" for t in range(round_ + 1)]
            pick = balancer.choose(replicas, "chat", hashes(chat(*turns)))
            counts[pick.id] += 1
            chosen_for.setdefault(conversation, []).append(pick.id)
            in_flight.append(pick)
        for pick in in_flight:
            balancer.release(pick)
        in_flight.clear()
    assert max(counts.values()) <= 0.65 * sum(counts.values())
    # Most turns of a conversation land where its earlier turns were.
    stays = sum(a == b for picks in chosen_for.values() for a, b in itertools.pairwise(picks))
    assert stays >= 0.8 * 8 * 9


# -- the model's routing setting, end to end through the gateway ----------------------------


@pytest.mark.django_db
def test_a_model_says_how_it_is_routed(gw: object, catalog: object) -> None:
    from catalog.models import Model
    from gateway import routing

    catalog.add("chat")  # type: ignore[attr-defined]
    catalog.add("plain", routing="least_loaded")  # type: ignore[attr-defined]
    entries = routing.read_catalog().entries
    assert (entries["chat"].routing, entries["plain"].routing) == ("prefix", "least_loaded")
    assert Model.objects.get(name="plain").definition()["routing"] == "least_loaded"
    assert "routing" not in Model.objects.get(name="chat").definition()


def test_an_unknown_routing_is_refused_with_the_choices() -> None:
    from catalog.definitions import clean_definition
    from core.refusals import Refused
    from tests.factories import definition

    with pytest.raises(Refused) as refused:
        clean_definition(definition("chat", routing="round_robin"))
    assert "round_robin is not a way of routing: use prefix or least_loaded" in str(
        refused.value.problems
    )


def _second_turn_stays(gw: object, catalog: object, engines: list, routing_mode: str) -> int:
    """Send a conversation's first turn, make the replica that took it one request busier,
    send the next turn: 1 when that turn went to the same replica, else 0."""
    from fleet.models import Replica
    from gateway.asgi import application

    assert application.gateway is not None
    balancer = application.gateway.balancer
    catalog.add("chat", routing=routing_mode)  # type: ignore[attr-defined]
    replicas = [catalog.replica("chat", e) for e in engines]  # type: ignore[attr-defined]
    for replica in replicas:  # two slots each, so the busier one still has one free
        Replica.objects.filter(pk=replica.pk).update(spec={**replica.spec, "slots": 2})
    # Loads are counted per slot of a hash of the replica's id (gateway.load), in this session's
    # one gateway: a request of an earlier test still ending on a replica whose id shares a slot
    # would make one of these look busy. Both idle first, or a clear failure.
    wait_for(
        lambda: all(balancer.load.total(str(r.pk), time.monotonic()) == 0 for r in replicas),
        timeout=10,
        what="no request in flight counted on either replica's slot",
    )
    assert gw.post("/v1/chat/completions", chat("first question")).status_code == 200  # type: ignore[attr-defined]
    first = next(i for i, e in enumerate(engines) if e.requests)
    balancer.load.add(str(replicas[first].pk), 1)  # busier, one slot still free
    try:
        body = chat("first question", "an answer", "a second question")
        assert gw.post("/v1/chat/completions", body).status_code == 200  # type: ignore[attr-defined]
    finally:
        balancer.load.add(str(replicas[first].pk), -1)
    return int(len(engines[first].requests) == 2)


@pytest.mark.django_db
def test_a_conversation_goes_back_where_its_beginning_is_cached(
    gw: object, catalog: object, engine: object, other_engine: object
) -> None:
    assert _second_turn_stays(gw, catalog, [engine, other_engine], "prefix") == 1
    scraped = gw.get("/metrics").text  # type: ignore[attr-defined]
    held = [line for line in scraped.splitlines() if line.startswith("llmgw_gateway_prefix_ent")]
    assert held and float(held[0].split()[-1]) > 0  # the two turns' blocks


@pytest.mark.django_db
def test_least_loaded_routing_ignores_the_cache(
    gw: object, catalog: object, engine: object, other_engine: object
) -> None:
    assert _second_turn_stays(gw, catalog, [engine, other_engine], "least_loaded") == 0

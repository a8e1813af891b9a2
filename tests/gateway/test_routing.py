"""Routing decisions, the choice among replicas, and when a failed attempt is sent again."""

from __future__ import annotations

import asyncio
import socket
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway import proxy, routing
from gateway.routing import Balancer, Candidate, Catalog, Entry, Serve, Unavailable, Wait, decide
from gateway.tracing import Tracer
from tests.gateway.fake_engine import fake_engine


def entry(name: str, **fields: Any) -> Entry:
    values: dict[str, Any] = {
        "name": name,
        "model": name,
        "adapter": False,
        "on_demand": False,
        "parked": False,
        "fallbacks": (),
        "idle_timeout": 0,
        "owner": "alice",
        "created": 0,
    }
    values.update(fields)
    return Entry(**values)


def replica(id: str, model: str, state: str = "ready", adapters: tuple[str, ...] = ()) -> Candidate:
    return Candidate(
        id=id,
        model=model,
        state=state,
        address="127.0.0.1",
        port=1,
        adapters=frozenset(adapters),
    )


def catalog_of(*entries: Entry) -> Catalog:
    return Catalog(entries={e.name: e for e in entries}, read_at=0)


# -- decide ---------------------------------------------------------------------------------


def test_it_serves_a_model_from_its_ready_replicas() -> None:
    chat = entry("chat")
    replicas = {"chat": [replica("a", "chat"), replica("b", "chat", state="starting")]}
    decision = decide(chat, replicas, catalog_of(chat), may_wait=True)
    assert decision == Serve(model="chat", engine_name="chat", candidates=(replicas["chat"][0],))


def test_an_adapter_goes_only_to_replicas_started_with_it() -> None:
    base = entry("chat")
    sql = entry("chat-sql", model="chat", adapter=True)
    old = replica("old", "chat")  # started before the adapter was added
    new = replica("new", "chat", adapters=("chat-sql",))
    decision = decide(sql, {"chat": [old, new]}, catalog_of(base, sql), may_wait=False)
    assert isinstance(decision, Serve)
    assert decision.candidates == (new,) and decision.engine_name == "chat-sql"
    assert decision.model == "chat-sql"


def test_an_on_demand_model_with_nothing_running_waits() -> None:
    chat = entry("chat", on_demand=True, fallbacks=("small",))
    small = entry("small")
    replicas = {"small": [replica("s", "small")]}
    assert decide(chat, replicas, catalog_of(chat, small), may_wait=True) == Wait(
        model="chat", on_demand=True
    )


def test_a_model_being_placed_waits_rather_than_fall_back() -> None:
    chat = entry("chat", fallbacks=("small",))
    small = entry("small")
    replicas = {"chat": [replica("c", "chat", state="fetching")], "small": [replica("s", "small")]}
    assert isinstance(decide(chat, replicas, catalog_of(chat, small), may_wait=True), Wait)


def test_with_nothing_coming_it_falls_back_in_order() -> None:
    chat = entry("chat", fallbacks=("medium", "small"))
    medium, small = entry("medium"), entry("small")
    replicas = {
        "medium": [replica("m", "medium", state="starting")],
        "small": [replica("s", "small")],
    }
    decision = decide(chat, replicas, catalog_of(chat, medium, small), may_wait=False)
    assert decision == Serve(
        model="small", engine_name="small", candidates=(replicas["small"][0],), fallback_from="chat"
    )


def test_when_the_wait_is_over_it_falls_back() -> None:
    chat = entry("chat", on_demand=True, fallbacks=("small",))
    small = entry("small")
    replicas = {"small": [replica("s", "small")]}
    decision = decide(chat, replicas, catalog_of(chat, small), may_wait=False)
    assert isinstance(decision, Serve) and decision.model == "small"


def test_it_falls_back_only_to_a_model_whose_engine_answers_the_endpoint() -> None:
    # vLLM computes no embeddings: a request for them skips its model and takes the next.
    chat = entry("chat", fallbacks=("big", "small"))
    big, small = entry("big", engine="vllm"), entry("small")
    replicas = {"big": [replica("b", "big")], "small": [replica("s", "small")]}
    catalog = catalog_of(chat, big, small)
    decision = decide(
        chat, replicas, catalog, may_wait=False, path="/v1/embeddings", needs="embeddings"
    )
    assert isinstance(decision, Serve) and decision.model == "small"
    # Chat completions, which both answer: the first in order.
    decision = decide(chat, replicas, catalog, may_wait=False, path="/v1/chat/completions")
    assert isinstance(decision, Serve) and decision.model == "big"
    # With only the one that cannot answer, the request is refused, and the answer says why.
    alone = entry("chat", fallbacks=("big",))
    decision = decide(
        alone,
        replicas,
        catalog_of(alone, big),
        may_wait=False,
        path="/v1/embeddings",
        needs="embeddings",
    )
    assert isinstance(decision, Unavailable)
    assert decision.message == (
        "chat has no ready replica right now; its fallback (big) cannot answer /v1/embeddings. "
        "Try again shortly; `llmgw ctl model target chat` shows why."
    )


def test_with_no_replica_and_no_fallback_it_says_why() -> None:
    parked = entry("chat", parked=True)
    decision = decide(parked, {}, catalog_of(parked), may_wait=True)
    assert decision == Unavailable(
        message="chat is in the catalog but deliberately not running (min 0, max 0). "
        "Its owner can start it with `llmgw ctl scale chat --min 1`.",
        retry_after=10,
    )
    plain = entry("chat", fallbacks=("small",))
    decision = decide(plain, {}, catalog_of(plain, entry("small")), may_wait=False)
    assert isinstance(decision, Unavailable)
    assert decision.message == (
        "chat has no ready replica right now; its fallbacks (small) have none either. "
        "Try again shortly; `llmgw ctl model target chat` shows why."
    )


def test_parked_models_without_fallbacks_are_not_listed() -> None:
    catalog = catalog_of(
        entry("parked", parked=True),
        entry("covered", parked=True, fallbacks=("live",)),
        entry("live"),
        entry("live-sql", model="live", adapter=True),
    )
    assert sorted(e.name for e in catalog.usable()) == ["covered", "live", "live-sql"]


def test_close_names_come_first() -> None:
    names = ["alpha", "chat", "chat-large", "embed", "qwen"]
    assert routing.entry_names_closest_first("chat-larg", names) == [
        "chat-large",
        "chat",
        "alpha",
        "embed",
        "qwen",
    ]
    assert len(routing.entry_names_closest_first("x", [f"m{i}" for i in range(50)], limit=20)) == 20


# -- the balancer ---------------------------------------------------------------------------


def test_it_picks_the_replica_with_the_fewest_requests_in_flight() -> None:
    balancer = Balancer()
    a, b, c = replica("a", "m"), replica("b", "m"), replica("c", "m")
    first = {balancer.choose([a, b, c], "m").id for _ in range(3)}
    assert first == {"a", "b", "c"}  # one each before any gets a second
    balancer.release(b)
    assert balancer.choose([a, b, c], "m") == b
    assert balancer.in_flight("b") == 1 and balancer.in_flight("a") == 1


def test_among_equals_it_prefers_the_replica_that_last_served_the_same_name() -> None:
    # An engine switching between its base model and an adapter reloads the model.
    balancer = Balancer()
    a, b = replica("a", "m", adapters=("sql",)), replica("b", "m", adapters=("sql",))
    balancer.release(balancer.choose([a], "sql"))
    balancer.release(balancer.choose([b], "m"))
    for _ in range(10):
        for name, expected in (("sql", a), ("m", b)):
            choice = balancer.choose([a, b], name)
            assert choice == expected
            balancer.release(choice)


def test_ties_are_broken_at_random() -> None:
    replicas = [replica(str(i), "m") for i in range(4)]
    assert {Balancer().choose(replicas, "m").id for _ in range(200)} == {"0", "1", "2", "3"}


def test_it_remembers_a_bounded_number_of_replicas_names_however_many_come_and_go() -> None:
    """Replicas come and go with every rollout: ten times the bound of them, each sent one
    request that ended, leave no more names remembered than the bound, and no more memory."""
    balancer = Balancer()
    sizes: Counter[int] = Counter()  # how often each size was reported: no growth of its own

    def remembered(size: int) -> None:
        sizes[size] += 1

    balancer.on_remembered = remembered
    bound = routing.MAX_REMEMBERED_REPLICAS

    def serve(index: int) -> None:
        balancer.release(balancer.choose([replica(f"replica-{index}", "m")], "m"))

    tracemalloc.start()
    try:
        for index in range(bound):
            serve(index)
        at_bound = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for index in range(bound, 10 * bound):
            serve(index)
        most_past_bound = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(sizes) == bound
    assert sizes[1] >= 9  # all idle: forgotten each time the bound was reached
    assert at_bound > 50 * bound  # what is measured holds the names
    assert most_past_bound < at_bound * 1.1, (at_bound, most_past_bound)


def test_the_names_remembered_are_counted_in_the_metrics(process_gateway: Any) -> None:
    process_gateway.balancer.choose([replica("a", "m"), replica("b", "m")], "m")
    registry = process_gateway.metrics.registry
    assert registry.get_sample_value("llmgw_gateway_replica_names_entries") == 1


def test_the_only_ready_replica_is_chosen_without_weighing_its_load(monkeypatch: Any) -> None:
    balancer = Balancer()

    def weighed(*_: Any) -> int:
        raise AssertionError("the load of the only candidate was read")

    monkeypatch.setattr(balancer.load, "total", weighed)
    only = replica("a", "chat")
    assert balancer.choose([only], "chat") == only
    assert balancer.reason == "the only one"
    assert balancer.in_flight("a") == 1  # still counted in flight
    balancer.release(only)
    assert balancer.in_flight("a") == 0


def test_a_choice_takes_over_the_slot_held_for_its_request() -> None:
    balancer = Balancer()
    a, b = replica("a", "m"), replica("b", "m")
    balancer.choose([b], "m")  # b is busy
    hold = balancer.hold(a)
    assert balancer.in_flight("a") == 1  # held: another process sees a busy
    assert balancer.choose([a, b], "m", hold=hold) == a  # its own slot, not counted against a
    assert balancer.in_flight("a") == 1 and hold.taken
    balancer.give_back(hold)  # taken: nothing to give back
    assert balancer.in_flight("a") == 1


def test_a_choice_elsewhere_gives_the_held_slot_back() -> None:
    balancer = Balancer()
    a, b = replica("a", "m"), replica("b", "m")
    balancer.choose([a], "m")  # a is busy, and its one slot is held once more
    hold = balancer.hold(a)
    assert balancer.choose([a, b], "m", hold=hold) == b
    assert balancer.in_flight("a") == 1 and balancer.in_flight("b") == 1


def test_a_hold_no_choice_took_is_given_back_once() -> None:
    balancer = Balancer()
    a = replica("a", "m")
    hold = balancer.hold(a)
    balancer.give_back(hold)
    balancer.give_back(hold)
    assert balancer.in_flight("a") == 0
    balancer.choose([a], "m", hold=hold)  # a hold given back counts nothing off
    assert balancer.in_flight("a") == 1


# -- retry once -----------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def on(port: int, id: str = "r") -> Candidate:
    return Candidate(id=id, model="m", state="ready", address="127.0.0.1", port=port)


def attempt_error(port: int, mode: str = "ok") -> BaseException:
    with fake_engine() as engine:
        engine.mode = mode
        try:
            run(
                lambda upstream: proxy._attempt(
                    upstream,
                    on(port or engine.port),
                    "/v1/completions",
                    b"{}",
                    stream=False,
                    tracer=Tracer(),
                )
            )
        except proxy.UpstreamError as exc:
            return exc
    raise AssertionError("the attempt did not fail")


def test_a_refused_connection_is_retried_even_if_the_replica_is_still_routable() -> None:
    error = attempt_error(closed_port())
    assert isinstance(error, proxy.NotConnected)
    assert proxy.should_retry(error, still_routable=True)


def test_a_reset_after_the_engine_took_the_request_is_retried_only_if_withdrawn() -> None:
    error = attempt_error(0, mode="reset")
    assert isinstance(error, proxy.Broken)
    assert proxy.should_retry(error, still_routable=False)
    assert not proxy.should_retry(error, still_routable=True)


def test_a_silent_engine_is_never_retried() -> None:
    assert not proxy.should_retry(proxy.Silent("slow"), still_routable=False)


def test_a_silent_engine_is_a_timeout(settings: Any) -> None:
    settings.LLMGW_GATEWAY_UPSTREAM_TIMEOUT = 1
    with fake_engine() as engine:
        engine.mode = "silent"
        with pytest.raises(proxy.ReplicaTimeout):
            send(
                serve(on(engine.port)),
                "/v1/completions",
                b"{}",
                stream=False,
                balancer=Balancer(),
                refresh=fixed(),
            )


def run(coroutine: Callable[[proxy.Upstream], Awaitable[Any]]) -> Any:
    """Run a coroutine of the proxy on a loop of its own, with connections of its own."""

    async def main() -> Any:
        upstream = proxy.Upstream()
        try:
            return await coroutine(upstream)
        finally:
            await upstream.close()

    return asyncio.run(main())


def send(*args: Any, **kwargs: Any) -> proxy.Answer:
    async def whole(upstream: proxy.Upstream) -> proxy.Answer:
        answer = await proxy.send(*args, upstream=upstream, tracer=Tracer(), **kwargs)
        if answer.streaming:
            answer.close()
        return answer

    return run(whole)


def fixed(*candidates: Candidate) -> Any:
    async def refresh() -> tuple[Candidate, ...]:
        return candidates

    return refresh


def serve(*candidates: Candidate) -> Serve:
    return Serve(model="m", engine_name="m", candidates=tuple(candidates))


def test_send_retries_once_on_another_replica_when_the_first_was_withdrawn() -> None:
    with fake_engine() as broken, fake_engine() as healthy:
        broken.mode = "reset"
        gone, good = on(broken.port, "gone"), on(healthy.port, "good")
        balancer = Balancer()
        answer = send(
            serve(gone),
            "/v1/completions",
            b'{"model": "m"}',
            stream=False,
            balancer=balancer,
            refresh=fixed(good),  # the first one was withdrawn meanwhile
        )
        assert answer.status == 200 and answer.retried and answer.candidate == good
        assert len(broken.requests) == 1 and len(healthy.requests) == 1
        assert balancer.in_flight("gone") == 0 and balancer.in_flight("good") == 1


def test_send_does_not_retry_when_the_replica_that_failed_is_still_in_routing() -> None:
    with fake_engine() as broken, fake_engine() as healthy:
        broken.mode = "reset"
        bad, good = on(broken.port, "bad"), on(healthy.port, "good")
        balancer = Balancer()
        with pytest.raises(proxy.ReplicaGone):
            send(
                serve(bad),
                "/v1/completions",
                b"{}",
                stream=False,
                balancer=balancer,
                refresh=fixed(bad, good),
            )
        assert healthy.requests == [] and balancer.in_flight("bad") == 0


def test_send_retries_only_once() -> None:
    with fake_engine() as first, fake_engine() as second:
        first.mode = second.mode = "reset"
        a, b = on(first.port, "a"), on(second.port, "b")
        with pytest.raises(proxy.ReplicaGone):
            send(
                serve(a),
                "/v1/completions",
                b"{}",
                stream=False,
                balancer=Balancer(),
                refresh=fixed(b),
            )
        assert len(first.requests) == 1 and len(second.requests) == 1


def test_a_stream_that_breaks_before_its_first_chunk_is_retried() -> None:
    with fake_engine() as broken, fake_engine() as healthy:
        broken.mode = "reset"
        gone, good = on(broken.port, "gone"), on(healthy.port, "good")
        answer = send(
            serve(gone),
            "/v1/completions",
            b'{"model": "m", "stream": true}',
            stream=True,
            balancer=Balancer(),
            refresh=fixed(good),
        )
        assert answer.streaming and answer.first.startswith(b"data: ")
        answer.close()


# -- tokens -----------------------------------------------------------------------------


def test_usage_is_read_from_the_answer() -> None:
    body = (
        b'{"choices": [{"text": "usage"}], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}'
    )
    assert proxy.usage_of(body) == (3, 5)
    assert proxy.usage_of(b'{"data": []}') == (0, 0)


def test_a_stream_counts_a_token_per_event() -> None:
    tally = proxy.StreamTally()
    role = b'data: {"choices": [{"delta": {"role": "assistant"}, "finish_reason": null}]}\n\n'
    token = b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": null}]}\n\n'
    end = b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
    for chunk in (role, token, token, token, end):
        tally.feed(chunk)
    assert tally.totals() == (0, 3)


# -- requests in flight over every gateway process ------------------------------------------


def test_the_counts_of_every_process_on_the_machine_are_added_up(tmp_path: Any) -> None:
    import os

    from gateway.load import SharedLoad

    # Two processes' counts (a second "process" is a second file, under this live pid's
    # neighbour: the parent's pid, alive for as long as this test runs).
    mine = SharedLoad(tmp_path)
    other = SharedLoad(tmp_path, pid=os.getppid())
    try:
        a, b = replica("a", "m"), replica("b", "m")
        theirs = Balancer(other)
        assert theirs.choose([a], "m") == a  # the other process sends one to a
        balancer = Balancer(mine)
        # This process has nothing in flight anywhere, yet it picks b: a is busy elsewhere.
        assert balancer.choose([a, b], "m") == b
        assert mine.total("a", now=1e9) == 1 and mine.total("b", now=1e9) == 1
        theirs.release(a)
        assert mine.total("a", now=2e9) == 0
    finally:
        other.close()
        mine.close()


def test_the_counts_of_a_process_that_is_gone_are_dropped(tmp_path: Any) -> None:
    from gateway.load import SharedLoad

    gone = SharedLoad(tmp_path, pid=2**22 + 12345)  # no such process
    gone.add("a", 3)
    mine = SharedLoad(tmp_path)
    try:
        assert mine.total("a", now=1e9) == 0
        assert not (tmp_path / f"load-{2**22 + 12345}").exists()
    finally:
        mine.close()


def test_the_counts_of_a_process_that_dies_after_it_was_seen_are_dropped(tmp_path: Any) -> None:
    import subprocess

    from gateway.boards import RESCAN_SECONDS
    from gateway.load import SharedLoad

    worker = subprocess.Popen(["sleep", "60"])  # a gateway worker, killed with requests in flight
    dying = SharedLoad(tmp_path, pid=worker.pid)
    dying.add("a", 2)
    mine = SharedLoad(tmp_path)
    try:
        assert mine.total("a", now=1e9) == 2
        worker.kill()
        worker.wait()
        assert mine.total("a", now=1e9 + RESCAN_SECONDS) == 0
        assert not (tmp_path / f"load-{worker.pid}").exists()
    finally:
        worker.kill()
        mine.close()


def test_a_replica_with_more_slots_takes_more_requests() -> None:
    balancer = Balancer()
    wide = Candidate(id="wide", model="m", state="ready", address="h", port=1, slots=4)
    narrow = Candidate(id="narrow", model="m", state="ready", address="h", port=2)
    chosen = [balancer.choose([wide, narrow], "m").id for _ in range(5)]
    assert sorted(chosen) == ["narrow", "wide", "wide", "wide", "wide"]


# -- a model that fits nowhere ------------------------------------------------------------


def test_an_on_demand_model_that_fits_no_node_is_refused_at_once_saying_why() -> None:
    lazy = entry("lazy", on_demand=True)
    decision = decide(
        lazy,
        {},
        catalog_of(lazy),
        may_wait=True,
        unplaceable={"lazy": "it fits on no node: its profiles need cpu: 64 GB, 8 cores, ..."},
    )
    assert isinstance(decision, Unavailable)
    assert decision.message.startswith(
        "lazy cannot be started: it fits on no node: its profiles need cpu: 64 GB"
    )
    assert "llmgw ctl model resources lazy" in decision.message

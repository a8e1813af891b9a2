"""Prefix-cache-aware routing against least-loaded routing, on two real llama-server replicas.

Two llama-server processes (4 slots each, one thread each, started as the node starts them,
RAM prompt cache included) serve a generated ~52 MB model, so that a prompt's prefill takes
real time. The gateway runs as the run command starts it (uvicorn, 2 workers) with two models
on the same two engines: one routed by prefix (the default), one least-loaded. The workload is
8 conversations of 10 turns sent at once, each turn after the last one's answer (back to back,
and again with a 1-4 s pause before each turn, as a person reads and writes), every
conversation starting with the same ~1,500-token system prompt; each user turn brings ~200
tokens of its own (pasted material), so a conversation's history grows to ~3,500 tokens as
real ones do; each turn is streamed and asks for 8 tokens, so time to first token is mostly
prefill. The two routings run in alternating rounds, each round with a system prompt of its
own (so neither finds the other's prompts in the engines' caches).

Printed: time to first token p50/p95, turns per second, each replica's share of the turns (from
the engines' own token counters) and the prompt tokens the engines computed and took from their
caches, with issue 14's targets: TTFT p50 at least 2x better with prefix routing, no replica
above 65% of the requests.

Run: make bench, or .venv/bin/python bench/routing.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file's folder holds a module named like the gateway package: keep it off the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.gateway import (  # noqa: E402
    DATABASE_PRELUDE,
    Processes,
    free_port,
    gateway_env,
    prepare_database,
    wait_http,
)
from llmgw.engine import EngineSettings, engine_command, find_engine  # noqa: E402
from llmgw.gguf import estimate_memory_bytes, read_header_from_file  # noqa: E402
from llmgw.tinygguf import LARGE, write_tiny_model  # noqa: E402

CONVERSATIONS = 8
TURNS = 10
ANSWER_TOKENS = 8
SYSTEM_TOKENS = 1500
USER_TURN_TOKENS = 200  # 10 turns add ~2,300 tokens (with answers) to the 1,500 shared ones
# Tokens per word of WORDS in the generated model's vocabulary: measured at start (tokens_per_word).
TOKENS_PER_WORD = {"ratio": 1.0}
SLOTS = 4
CONTEXT = 5120  # per slot: a conversation reaches ~3,900 tokens by its last turn
ROUTINGS = {"prefix": "bench-prefix", "least_loaded": "bench-least"}
# Two ways users send their turns. Back to back, each turn the moment the last answer ends, the
# engine a conversation just left is the least busy when its next turn comes, so least-loaded
# routing sends it back there by itself. With a pause between turns (a person reading the answer
# and writing the next question), the next turn finds the engines as the other conversations
# left them, as it is in production.
WORKLOADS: dict[str, tuple[float, float] | None] = {
    "back to back": None,
    "1-4 s pauses": (1.0, 4.0),
}
WORDS = [
    "the",
    "model",
    "answers",
    "a",
    "small",
    "question",
    "about",
    "the",
    "tiny",
    "llama",
    "and",
    "the",
    "random",
    "weights",
    "it",
    "has",
    "and",
    "the",
    "user",
    "asks",
    "the",
    "assistant",
    "again",
    "about",
    "the",
    "world",
]


def words_for(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD["ratio"]))


def tokens_per_word(port: int) -> float:
    """How many tokens the engine makes of a WORDS word, on average (a sample of 1,000)."""
    rng = random.Random(0)
    sample = " ".join(rng.choice(WORDS) for _ in range(1000))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/tokenize",
        data=json.dumps({"content": sample}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return len(json.loads(response.read())["tokens"]) / 1000


def system_prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = words_for(SYSTEM_TOKENS)
    return f"round {seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def user_turn(seed: int, conversation: int, number: int) -> str:
    """What a user sends in one turn: a question with a few hundred tokens of material pasted
    in (a document, code, an earlier answer), so that a conversation's history grows as real
    ones do, and recomputing it where it is not cached costs what it costs in production."""
    rng = random.Random(f"{seed}/{conversation}/{number}")
    material = " ".join(rng.choice(WORDS) for _ in range(words_for(USER_TURN_TOKENS)))
    return f"question {number} of conversation {conversation}: {material}"


def prepare(folder: Path, ports: list[int]) -> tuple[dict[str, str], str]:
    env = gateway_env(folder)
    script = (
        DATABASE_PRELUDE
        + f"""
for name, routing in {[(m, r) for r, m in ROUTINGS.items()]!r}:
    model_add(actor=actor, source_check=False, definition=clean_definition({{
        "name": name, "source": "http://127.0.0.1:9/bench.gguf", "routing": routing,
        "min_replicas": 2,
        "profiles": [{{"name": "cpu", "memory_gb": 1, "cores": 1}}]}}))
    for port in {ports!r}:
        Replica.objects.create(model=Model.objects.get(name=name), model_name=name, node=node,
            profile="cpu", spec={{"slots": {SLOTS}}}, spec_key="bench", state=Replica.READY,
            port=port)
print(key_create(actor=actor, name="bench")[1])
"""
    )
    return env, prepare_database(script, env)


ENGINE_COUNTERS = {
    "llamacpp:tokens_predicted_total": "predicted",
    "llamacpp:prompt_tokens_total": "computed",  # prompt tokens prefilled (not from a cache)
    "llamacpp:prompt_tokens_cached_total": "cached",
}


def engine_counters(port: int) -> dict[str, float]:
    """The engine's own counters: tokens generated, prompt tokens computed and from its cache."""
    found = dict.fromkeys(ENGINE_COUNTERS.values(), 0.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            name = line.split(" ")[0]
            if name in ENGINE_COUNTERS:
                found[ENGINE_COUNTERS[name]] = float(line.split()[-1])
    return found


def prompt_cache_mib(model_path: Path, context: int) -> int:
    """The RAM prompt cache the node gives an engine: one slot's KV cache (llmgw/node.py)."""
    header = read_header_from_file(model_path, require_tensors=False)
    one_slot = estimate_memory_bytes(header, file_size=0, context_length=context).prompt_cache_bytes
    return max(1, -(-one_slot // (1 << 20)))


async def turn(url: str, key: str, model: str, messages: list[dict[str, str]]) -> tuple[float, str]:
    """One streamed turn: (seconds to the first token, the answer's text)."""
    import aiohttp

    body = {
        "model": model,
        "messages": messages,
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    first = None
    text = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=aiohttp.ClientTimeout(total=300),
        ) as response,
    ):
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            piece = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if piece:
                if first is None:
                    first = time.monotonic() - started
                text.append(piece)
    return (first if first is not None else time.monotonic() - started), "".join(text)


def pause(conversation: int, number: int, pauses: tuple[float, float] | None) -> float:
    """Seconds the user takes before turn `number` (reading the answer, writing the next
    question): the same for every round and routing, so that both see one schedule."""
    if pauses is None or number == 0:
        return 0.0
    return random.Random(f"pause/{conversation}/{number}").uniform(*pauses)


async def workload(
    url: str, key: str, model: str, seed: int, pauses: tuple[float, float] | None
) -> tuple[list[float], float]:
    """Every conversation at once, turn after turn: (times to first token, wall seconds)."""
    system = system_prompt(seed)
    firsts: list[float] = []

    async def conversation(index: int) -> None:
        messages = [{"role": "system", "content": system}]
        for number in range(TURNS):
            await asyncio.sleep(pause(index, number, pauses))
            messages.append({"role": "user", "content": user_turn(seed, index, number)})
            first, answer = await turn(url, key, model, messages)
            firsts.append(first)
            messages.append({"role": "assistant", "content": answer or "yes"})

    started = time.monotonic()
    await asyncio.gather(*(conversation(i) for i in range(CONVERSATIONS)))
    return firsts, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each routing")
    args = parser.parse_args()
    print("== routing: prefix-cache-aware vs least-loaded (bench/routing.py)")
    executable = find_engine()
    if executable is None:
        print("routing bench: skipped, llama-server is not built (make setup builds it)")
        return 0
    folder = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    model_path = folder / "large.gguf"
    write_tiny_model(model_path, seed=1, shape=LARGE, context_length=CONTEXT)
    processes = Processes(folder)
    ports = [free_port(), free_port()]
    try:
        for index, port in enumerate(ports):
            settings = EngineSettings(
                model_path=str(model_path),
                model_alias="bench",
                host="127.0.0.1",
                port=port,
                context_length=CONTEXT,
                slots=SLOTS,
                threads=1,
                # As the node starts it (both routings alike): one slot's worth of RAM cache.
                prompt_cache_mib=prompt_cache_mib(model_path, CONTEXT),
            )
            processes.start(f"engine-{index}", engine_command(settings, executable))
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/health", "llama-server")
        TOKENS_PER_WORD["ratio"] = tokens_per_word(ports[0])
        env, key = prepare(folder, ports)
        gateway_port = free_port()
        processes.start(
            "gateway",
            [
                str(Path(sys.executable).parent / "uvicorn"),
                "gateway.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(gateway_port),
                "--workers",
                "2",
                "--no-access-log",
                "--log-level",
                "warning",
            ],
            env=env,
        )
        url = f"http://127.0.0.1:{gateway_port}"
        wait_http(f"{url}/v1/models", "the gateway", headers={"Authorization": f"Bearer {key}"})
        results: dict[tuple[str, str], dict[str, list[float]]] = {
            (w, r): {"firsts": [], "walls": [], "shares": [], "computed": [], "cached": []}
            for w in WORKLOADS
            for r in ROUTINGS
        }
        seed = 0
        for name, pauses in WORKLOADS.items():
            for _ in range(args.rounds):
                for routing, model in ROUTINGS.items():
                    seed += 1
                    before = [engine_counters(p) for p in ports]
                    firsts, wall = asyncio.run(workload(url, key, model, seed, pauses))
                    after = [engine_counters(p) for p in ports]
                    delta = [
                        {k: b[k] - a[k] for k in a} for a, b in zip(before, after, strict=True)
                    ]
                    served = [d["predicted"] for d in delta]
                    computed = sum(d["computed"] for d in delta)
                    cached = sum(d["cached"] for d in delta)
                    figures = results[name, routing]
                    figures["firsts"] += firsts
                    figures["walls"].append(wall)
                    figures["shares"].append(max(served) / max(sum(served), 1))
                    figures["computed"].append(computed)
                    figures["cached"].append(cached)
                    print(
                        f"  round {seed}: {name}, {routing:12s} TTFT p50 "
                        f"{statistics.median(firsts) * 1000:7.1f} ms, wall {wall:6.1f} s, "
                        f"replicas {served[0] / max(sum(served), 1):.0%} / "
                        f"{served[1] / max(sum(served), 1):.0%}, prompt tokens computed "
                        f"{computed:,.0f}, from the engines' caches {cached:,.0f}",
                        flush=True,
                    )
    finally:
        processes.stop_all()

    turns = CONVERSATIONS * TURNS
    print(
        f"\n  {CONVERSATIONS} conversations x {TURNS} turns at once, ~1,500-token shared system "
        f"prompt, ~{USER_TURN_TOKENS} tokens per user turn, {ANSWER_TOKENS} tokens per answer, "
        f"2 replicas x {SLOTS} slots, {args.rounds} rounds each, alternating"
    )
    print(
        f"  {'workload':14s} {'routing':14s} {'TTFT p50':>10s} {'TTFT p95':>10s} {'turns/s':>9s} "
        f"{'busiest replica':>16s} {'prefilled/round':>16s} {'cached/round':>13s}"
    )
    for name in WORKLOADS:
        p50 = {}
        for routing in ROUTINGS:
            figures = results[name, routing]
            firsts = sorted(figures["firsts"])
            p50[routing] = statistics.median(firsts)
            p95 = firsts[int(0.95 * (len(firsts) - 1))]
            rate = turns / statistics.median(figures["walls"])
            print(
                f"  {name:14s} {routing:14s} {p50[routing] * 1000:8.1f}ms {p95 * 1000:8.1f}ms "
                f"{rate:9.2f} {max(figures['shares']):>15.0%} "
                f"{statistics.mean(figures['computed']):>16,.0f} "
                f"{statistics.mean(figures['cached']):>13,.0f}"
            )
        gain = p50["least_loaded"] / max(p50["prefix"], 1e-9)
        busiest = max(results[name, "prefix"]["shares"])
        print(
            f"  targets (issue 14), {name}: TTFT p50 >= 2x better with prefix routing: "
            f"{gain:.2f}x ({'met' if gain >= 2 else 'NOT met'}); no replica above 65%: "
            f"{busiest:.0%} ({'met' if busiest <= 0.65 else 'NOT met'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

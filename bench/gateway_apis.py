"""What each API costs through the gateway: chat completions, the Responses API and Anthropic's
Messages API, side by side, on the fast fake upstream (bench/fake_upstream.py, which answers each
in its own shape), with LiteLLM's proxy beside llmgw when it is installed (bench/gateway.py
installs it).

    python bench/gateway_apis.py [--quick] [--no-litellm]

Two figures per API, measured in interleaved rounds (API after API, path after path, so that the
shared machine's noise falls on all alike):

- whole answers at one client: the median time over going straight to the upstream, and what
  the Responses and Messages APIs add over chat completions (target: at most 0.1 ms more);
- 512 concurrent 1-s streams (20 events 50 ms apart): wall time over the ideal 1 s (target:
  within 1.2), and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import (  # noqa: E402
    LITELLM_INSTALL_SECONDS,
    LITELLM_KEY,
    STREAM_SECONDS,
    WORKERS,
    Processes,
    Sample,
    free_port,
    litellm_install,
    litellm_installed,
    percentile,
    prepare_gateway,
    run_cell,
    start_litellm,
    start_upstreams,
    tree_cpu_seconds,
    wait_http,
)

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
TARGET_ADDED_MS = 0.1
TARGET_WALL = 1.2
STREAMS = 512
TARGETS = (
    f"targets (issue 40): /v1/responses and /v1/messages add at most {TARGET_ADDED_MS} ms more "
    f"than chat completions at one client (whole answers, p50); {STREAMS} concurrent 1-s streams "
    f"of each within {TARGET_WALL}x the ideal time, 0 errors"
)


def body(api: str, model: str, stream: bool) -> bytes:
    if api == "chat":
        asked: dict[str, Any] = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16,
        }
    elif api == "responses":
        asked = {"input": "hello", "max_output_tokens": 16}
    else:
        asked = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
    return json.dumps({"model": model, **asked, "stream": stream}).encode()


def headers_for(path: str, key: str, api: str) -> dict[str, str]:
    if path == "direct":
        return {}
    if api == "messages":
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return {"Authorization": f"Bearer {key}"}


async def measure(
    paths: dict[str, tuple[str, str, int | None]], quick: bool
) -> tuple[dict[tuple[str, str], Sample], dict[tuple[str, str], Sample]]:
    """(whole answers at one client, STREAMS streams) per (api, path)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=300)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout, auto_decompress=False
    )
    whole: dict[tuple[str, str], Sample] = {}
    streams: dict[tuple[str, str], Sample] = {}
    rounds, per_round = (3, 200) if quick else (6, 400)
    try:
        for api in APIS:  # warm every path: connections, each worker's first request
            for name, (base, key, _) in paths.items():
                url, headers = base + PATHS[api], headers_for(name, key, api)
                await run_cell(
                    session, url, headers, body(api, "bench-fast", False), 4, 16, Sample()
                )
        for number in range(rounds):
            for api in APIS:
                for name, (base, key, pid) in paths.items():
                    cell = whole.setdefault((api, name), Sample())
                    before = tree_cpu_seconds(pid) if pid else 0.0
                    await run_cell(
                        session,
                        base + PATHS[api],
                        headers_for(name, key, api),
                        body(api, "bench-fast", False),
                        1,
                        per_round,
                        cell,
                    )
                    if pid:
                        cell.cpu += tree_cpu_seconds(pid) - before
            print(f"  whole answers: round {number + 1} of {rounds}", file=sys.stderr, flush=True)
        for number in range(1 if quick else 3):
            for api in APIS:
                for name, (base, key, _) in paths.items():
                    await run_cell(
                        session,
                        base + PATHS[api],
                        headers_for(name, key, api),
                        body(api, "bench-slow", True),
                        STREAMS,
                        STREAMS,
                        streams.setdefault((api, name), Sample()),
                    )
            print(f"  streams: round {number + 1}", file=sys.stderr, flush=True)
    finally:
        await session.close()
    return whole, streams


def report(
    whole: dict[tuple[str, str], Sample],
    streams: dict[tuple[str, str], Sample],
    names: list[str],
) -> bool:
    ms = 1000.0
    print("\nwhole answers at 1 client (p50 over going direct, ms; CPU ms a request)")
    print(f"{'api':<10}{'path':<9}{'n':>6}{'p50':>8}{'+p50':>8}{'+p99':>8}{'errors':>8}{'cpu':>8}")
    added: dict[tuple[str, str], float] = {}
    for api in APIS:
        direct = whole[(api, "direct")]
        d50, d99 = percentile(direct.totals, 0.5), percentile(direct.totals, 0.99)
        for name in names:
            sample = whole[(api, name)]
            p50, p99 = percentile(sample.totals, 0.5), percentile(sample.totals, 0.99)
            added[(api, name)] = p50 - d50
            cpu = f"{sample.cpu / max(1, len(sample.totals)) * ms:.3f}" if sample.cpu else "-"
            plus = "" if name == "direct" else f"{(p50 - d50) * ms:>8.3f}{(p99 - d99) * ms:>8.3f}"
            print(
                f"{api:<10}{name:<9}{len(sample.totals):>6}{p50 * ms:>8.3f}"
                f"{plus or '':>16}{sample.errors:>8}{cpu:>8}"
            )
    print(
        f"\n{STREAMS} concurrent 1-s streams (wall time over the ideal {STREAM_SECONDS:.0f} s: the "
        "rounds' mean, as bench/gateway.py gives it, and the worst round)"
    )
    print(f"{'api':<10}{'path':<9}{'n':>6}{'wall/ideal':>12}{'worst':>8}{'errors':>8}")
    for api in APIS:
        for name in names:
            sample = streams[(api, name)]
            wall, worst = _walls(sample)
            print(
                f"{api:<10}{name:<9}{len(sample.totals):>6}{wall:>12.2f}{worst:>8.2f}"
                f"{sample.errors:>8}"
            )
    print(f"\n{TARGETS}")
    met = True
    for api in ("responses", "messages"):
        more = (added[(api, "llmgw")] - added[("chat", "llmgw")]) * ms
        ok = more <= TARGET_ADDED_MS
        met &= ok
        print(
            f"  llmgw {api}: {more:+.3f} ms over chat completions at 1 client "
            f"(<= {TARGET_ADDED_MS}: {'met' if ok else 'NOT met'})"
        )
        if "litellm" in names:
            print(
                f"    LiteLLM {api}: {(added[(api, 'litellm')] - added[('chat', 'litellm')]) * ms:+.3f} ms over its chat completions; "
                f"it adds {added[(api, 'litellm')] * ms:.3f} ms over direct, llmgw {added[(api, 'llmgw')] * ms:.3f} ms"
            )
    for api in APIS:
        sample = streams[(api, "llmgw")]
        wall, _ = _walls(sample)
        ok = wall <= TARGET_WALL and sample.errors == 0
        met &= ok or api == "chat"
        print(
            f"  llmgw {STREAMS} {api} streams: {wall:.2f} of ideal, {sample.errors} errors "
            f"(<= {TARGET_WALL}, 0: {'met' if ok else 'NOT met'})"
        )
    return met


def _walls(sample: Sample) -> tuple[float, float]:
    """A cell's wall time over the ideal: the rounds' mean, and the worst round."""
    if not sample.walls:
        return float("nan"), float("nan")
    walls = [wall / STREAM_SECONDS for wall in sample.walls]
    return sum(walls) / len(walls), max(walls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    parser.add_argument("--no-litellm", action="store_true", help="without LiteLLM beside it")
    args = parser.parse_args()
    installing = None if args.no_litellm else litellm_install()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-apis-") as tmp:
        folder = Path(tmp)
        processes = Processes(folder)
        try:
            upstream_port, second_port = start_upstreams(processes)
            upstream = f"http://127.0.0.1:{upstream_port}"
            env, key = prepare_gateway(folder, upstream_port, second_port)
            from llmgw_site.management.commands.llmgw_run import gateway_command

            port = free_port()
            processes.start(
                "llmgw",
                gateway_command(Path(sys.executable).parent, "127.0.0.1", port, workers=WORKERS),
                env,
            )
            gateway = f"http://127.0.0.1:{port}"
            wait_http(
                f"{gateway}/v1/models", "the gateway", headers={"Authorization": f"Bearer {key}"}
            )
            paths: dict[str, tuple[str, str, int | None]] = {
                "direct": (upstream, "", None),
                "llmgw": (gateway, key, processes.pid("llmgw")),
            }
            if installing is not None:
                try:
                    installing.wait(timeout=LITELLM_INSTALL_SECONDS)
                except subprocess.TimeoutExpired:
                    os.killpg(installing.pid, signal.SIGKILL)
            if not args.no_litellm and litellm_installed():
                litellm = start_litellm(processes, folder, upstream_port)
                paths["litellm"] = (litellm, LITELLM_KEY, processes.pid("litellm"))
            elif not args.no_litellm:
                print("LiteLLM is not installed: measured without it", file=sys.stderr)
            whole, streams = asyncio.run(measure(paths, args.quick))
            met = report(whole, streams, list(paths))
        finally:
            processes.stop_all()
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

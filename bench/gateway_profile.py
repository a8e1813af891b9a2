"""Where a gateway worker's CPU goes: whole answers through the gateway (as bench/gateway.py starts it,
on the fake upstream), at 1 client and at 32, with py-spy sampling both workers meanwhile.

For each level it prints the requests served, the workers' CPU per request (/proc), and the
functions that held the most samples: by their own time (the frame on top) and by the time spent
in them and what they called (inclusive), each as a share of all samples. Idle time (the event
loop waiting in epoll) is counted apart, so the shares are of the time a worker was busy.

    .venv/bin/python bench/gateway_profile.py [--seconds 8] [--levels 1,32] [--top 25]
        [--baseline REV] [--raw DIR]

--baseline REV profiles REV's gateway too, in alternating turns; --raw keeps py-spy's raw files
(flamegraph.pl or speedscope read them). Needs py-spy (the dev extra installs it) and the right to
read another process's memory (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import (  # noqa: E402
    WORKERS,
    Processes,
    Sample,
    free_port,
    prepare_gateway_keys,
    remove_baseline,
    run_cell,
    start_baseline,
    start_upstreams,
    tree_cpu_seconds,
    wait_http,
)

# py-spy's options: --nonblocking (the worker is not paused to be sampled), or with --native,
# which needs the pause, the C frames too (uvloop's, the kernel's calls).
NATIVE = ["--nonblocking"]
WHOLE_BODY = b'{"model": "bench-fast", "messages": [{"role": "user", "content": "hi"}]}'
# 20 events 50 ms apart (bench/fake_upstream.py): about a second each.
STREAM_BODY = (
    b'{"model": "bench-slow", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
)

# The frames of a worker waiting for work, not doing it.
IDLE = re.compile(
    r"\b(select|poll|epoll_wait|_run_once)\b.*(selectors|uvloop)|^\s*wait \(threading"
)
FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def workers_of(pid: int) -> list[int]:
    """The uvicorn parent's worker processes."""
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    # Workers are started by multiprocessing's spawn (a resource tracker may be a child too).
    return [int(p) for p in found.split() if "spawn_main" in _cmdline(int(p))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def short(frame: str) -> str:
    """`function (path/to/module.py:LINE)` as `function (module.py)`: a function's lines merged."""
    matched = FRAME.match(frame.strip())
    if matched is None:
        return frame.strip()
    path = matched["file"]
    for marker in ("site-packages/", "/work/", "python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{matched['name']} ({path})"


def read_raw(paths: list[Path]) -> tuple[Counter[str], Counter[str], int, int]:
    """Own and inclusive samples per function, the busy samples and the idle ones."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    busy = idle = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not count_text.isdigit():
                continue
            count = int(count_text)
            frames = [short(f) for f in stack.split(";") if f.strip()]
            if not frames:
                continue
            if any(IDLE.search(f) for f in frames[-2:]) or frames[0].startswith("wait ("):
                idle += count
                continue
            busy += count
            own[frames[-1]] += count
            for name in set(frames):
                inclusive[name] += count
    return own, inclusive, busy, idle


async def drive(
    url: str, headers: dict[str, str], body: bytes, clients: int, seconds: float, rounds: int
) -> int:
    import aiohttp

    sample = Sample()
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        while time.monotonic() < deadline:
            await run_cell(session, url, headers, body, clients, clients * rounds, sample)
    return len(sample.totals)


def profile(
    name: str,
    url: str,
    pid: int,
    headers: dict[str, str],
    clients: int,
    seconds: float,
    folder: Path,
    top: int,
    stream: bool,
) -> None:
    body = STREAM_BODY if stream else WHOLE_BODY
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    recorders = []
    raws = []
    for worker in workers_of(pid):
        raw = folder / f"{name}-{clients}-{worker}.txt"
        raws.append(raw)
        recorders.append(
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "-r",
                    "250",
                    "-f",
                    "raw",
                    "--nonblocking",
                    "-d",
                    str(int(seconds) + 1),
                    "-o",
                    str(raw),
                    "-p",
                    str(worker),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(0.5)
    before = tree_cpu_seconds(pid)
    served = asyncio.run(drive(url, headers, body, clients, seconds, 1 if stream else 50))
    cpu = tree_cpu_seconds(pid) - before
    for recorder in recorders:
        recorder.wait(timeout=seconds + 30)
    own, inclusive, busy, idle = read_raw(raws)
    print(
        f"\n== {name}{' streams' if stream else ''}, {clients} client{'s' if clients > 1 else ''}: {served} requests, "
        f"{cpu / max(1, served) * 1000:.3f} ms CPU a request (both workers, sampled included); "
        f"busy {busy} samples, idle {idle}"
    )
    width = 88
    print(f"  {'own %':>6} {'incl %':>6}  function")
    for function, count in own.most_common(top):
        print(
            f"  {count / busy * 100:6.1f} {inclusive[function] / busy * 100:6.1f}  {function[:width]}"
        )
    print(f"  -- inclusive, top {top} --")
    for function, count in inclusive.most_common(top):
        print(f"  {own[function] / busy * 100:6.1f} {count / busy * 100:6.1f}  {function[:width]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--levels", default="1,32")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--baseline", metavar="REV")
    parser.add_argument("--raw", metavar="DIR", help="keep py-spy's raw files here")
    parser.add_argument(
        "--stream", action="store_true", help="streamed answers (bench-slow) instead of whole ones"
    )
    parser.add_argument(
        "--native", action="store_true", help="C frames too (uvloop, syscalls); pauses to sample"
    )
    args = parser.parse_args()
    if args.native:
        NATIVE[:] = ["--native"]
    levels = [int(x) for x in args.levels.split(",")]
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-prof-") as tmp:
        folder = Path(tmp)
        raw_folder = Path(args.raw) if args.raw else folder
        raw_folder.mkdir(parents=True, exist_ok=True)
        processes = Processes(folder)
        try:
            upstream_port, second_port = start_upstreams(processes)
            env, secrets = prepare_gateway_keys(folder, upstream_port, second_port)
            auth = {"Authorization": f"Bearer {secrets['bench']}"}
            from llmgw_site.management.commands.llmgw_run import gateway_command

            port = free_port()
            processes.start(
                "llmgw",
                gateway_command(Path(sys.executable).parent, "127.0.0.1", port, workers=WORKERS),
                env,
            )
            gateways = {"llmgw": f"http://127.0.0.1:{port}"}
            if args.baseline:
                gateways["before"] = start_baseline(processes, folder, args.baseline, env)
            for name, url in gateways.items():
                wait_http(f"{url}/v1/models", f"the gateway {name}", headers=auth)
            time.sleep(2)  # the workers' start-up work done
            for clients in levels:
                for name, url in gateways.items():
                    profile(
                        name,
                        f"{url}/v1/chat/completions",
                        processes.pid(name),
                        auth,
                        clients,
                        args.seconds,
                        raw_folder,
                        args.top,
                        args.stream,
                    )
        finally:
            processes.stop_all()
            if args.baseline:
                remove_baseline(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

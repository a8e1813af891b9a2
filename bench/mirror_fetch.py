"""Fetching a large file (2 GB by default) through the mirror and then by a node, each side by side
with a plain download of the same file from the same server: throughput ratio (goal >= 0.9) and
the peak memory of each fetching process (it must stay flat, not grow with the file).

Every fetch runs in a process of its own, so that its peak memory (ru_maxrss) is its alone.

Run: make bench (or .venv/bin/python bench/mirror_fetch.py [--size-mb 2048])
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PLAIN = """
import os, sys, time, requests
url, out = sys.argv[1], sys.argv[2]
token = os.environ.get("BENCH_TOKEN")
headers = {"Authorization": f"Bearer {token}"} if token else {}
with requests.get(url, stream=True, timeout=(10, 600), headers=headers) as r, open(out, "wb") as f:
    r.raise_for_status()
    for chunk in r.iter_content(1024 * 1024):
        f.write(chunk)
"""

NODE = """
import os, sys, threading
from pathlib import Path
from llmgw.node.cache import BlobCache
# The mirror serves nodes only with their token, as the agent sends it.
token = os.environ["BENCH_TOKEN"]
cache = BlobCache(Path(sys.argv[2]), credentials=lambda url: {"Authorization": f"Bearer {token}"})
cache.prepare()
cache.fetch(sys.argv[1], sys.argv[3], label="weights", progress=lambda *a: None, cancelled=threading.Event())
"""


def measured(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS in MB of one child process."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed with {process.returncode}")
    return elapsed, usage.ru_maxrss / 1024


def make_file(path: Path, size_mb: int) -> None:
    block = os.urandom(64 * 1024 * 1024)
    with path.open("wb") as out:
        written = 0
        while written < size_mb * 1024 * 1024:
            piece = block[: min(len(block), size_mb * 1024 * 1024 - written)]
            out.write(piece)
            written += len(piece)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=2048)
    args = parser.parse_args()
    from tests.support.registry import LocalRegistry
    from tests.support.system import System, wait_for

    folder = Path(tempfile.mkdtemp(prefix="llmgw-bench-mirror-"))
    big = folder / "big.gguf"
    make_file(big, args.size_mb)
    size = big.stat().st_size
    registry = LocalRegistry(folder / "registry")
    started = time.perf_counter()
    commit = registry.commit("bench/big", {"big.gguf": big})
    big.unlink()
    print(
        f"mirror_fetch: a {size / 1e6:.0f} MB file committed with git-lfs in {time.perf_counter() - started:.0f}s"
    )
    registry.start()
    system = System(folder / "system", config={"registry": {"endpoint": registry.endpoint}})
    try:
        system.start(worker=False)  # the fetch runs in a measured process of its own
        python = sys.executable
        registry_url = f"{registry.endpoint}/bench/big/resolve/{commit}/big.gguf"
        # olah reads a file into memory on first access; a warm-up keeps that out of the figures.
        measured([python, "-c", PLAIN, registry_url, str(folder / "warm")])
        (folder / "warm").unlink()

        rows = []
        plain_registry = measured([python, "-c", PLAIN, registry_url, str(folder / "plain-1")])
        (folder / "plain-1").unlink()
        fetch = system.api(
            "POST", "serve", json={"repo": "bench/big", "min": 0, "max": 0, "memory_gb": 4}
        )
        mirror = measured(
            [
                python,
                "manage.py",
                "shell",
                "-c",
                f"from registry.fetches import run_fetch; run_fetch({fetch['id']})",
            ],
            env=system.env,
        )
        done = wait_for(
            lambda: system.api("GET", f"fetches/{fetch['id']}"), what="the fetch record"
        )
        assert done["state"] == "done", done
        rows.append(("registry -> mirror", plain_registry, mirror))

        mirror_url = f"{system.url}/mirror/bench/big/{commit}/big.gguf"
        # The mirror answers nodes and logged-in people only: both sides read as a node does,
        # the token in the environment (never in argv).
        node_token = system.api("POST", "nodes", json={"name": "bench-node"})["token"]
        as_node = {**os.environ, "BENCH_TOKEN": node_token}
        sha = system.api("GET", "models/big")["origin"]["files"][0]["sha256"]
        plain_mirror = measured(
            [python, "-c", PLAIN, mirror_url, str(folder / "plain-2")], env=as_node
        )
        (folder / "plain-2").unlink()
        node = measured(
            [python, "-c", NODE, mirror_url, str(folder / "node-cache"), sha], env=as_node
        )
        rows.append(("mirror -> node", plain_mirror, node))

        print(
            f"{'path':<20} {'plain MB/s':>10} {'ours MB/s':>10} {'ratio':>6} {'plain peak MB':>14} {'ours peak MB':>13}"
        )
        for label, (plain_s, plain_rss), (ours_s, ours_rss) in rows:
            print(
                f"{label:<20} {size / 1e6 / plain_s:>10.0f} {size / 1e6 / ours_s:>10.0f} "
                f"{plain_s / ours_s:>6.2f} {plain_rss:>14.0f} {ours_rss:>13.0f}"
            )
    finally:
        system.close()
        registry.stop()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

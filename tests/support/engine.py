"""One llama-server on 127.0.0.1, started the way the node agent starts it, for tests and
benchmarks that talk to the engine itself. Stopped by its pid when the block ends."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw import engine


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running_engine(
    model: Path,
    *,
    alias: str = "tiny-chat",
    adapters: tuple[engine.AdapterEntry, ...] = (),
    context_length: int = 256,
    slots: int = 1,
    threads: int = 1,
    prompt_cache_mib: int = 64,
    log: Path,
    ready_timeout: float = 60,
) -> Iterator[str]:
    """Yields the engine's base URL once /health answers 200."""
    executable = engine.find_engine()
    assert executable is not None, "llama-server is not built (make setup builds it)"
    settings = engine.EngineSettings(
        model_path=str(model),
        model_alias=alias,
        host="127.0.0.1",
        port=free_port(),
        context_length=context_length,
        prompt_cache_mib=prompt_cache_mib,
        slots=slots,
        threads=threads,
        adapters=adapters,
    )
    process = engine.start_engine(engine.engine_command(settings, executable), log)
    try:
        deadline = time.monotonic() + ready_timeout
        while engine.health("127.0.0.1", settings.port, timeout=1) is not None:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {engine.last_output(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy in time: {engine.last_output(log)}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        engine.stop_process_group(process.pid, child=process, grace=5)

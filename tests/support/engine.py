"""One llama-server on 127.0.0.1, started the way the node agent starts it, for tests and
benchmarks that talk to the engine itself. Stopped by its pid when the block ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw import engine
from tests.support.ports import free_port
from tests.support.waiting import wait_for

__all__ = ["free_port", "running_engine"]


@contextmanager
def running_engine(
    model: Path,
    *,
    alias: str = "tiny-chat",
    adapters: tuple[engine.AdapterEntry, ...] = (),
    mmproj: Path | None = None,
    reranking: bool = False,
    context_length: int = 256,
    slots: int = 1,
    threads: int = 1,
    prompt_cache_mib: int = 64,
    log: Path,
    ready_timeout: float = 60,
) -> Iterator[str]:
    """Yields the engine's base URL once /health answers 200. ``mmproj``: a vision projector
    for the model (llama-server's --mmproj), so that it takes images. ``reranking``: it ranks
    documents instead of computing embeddings."""
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
        mmproj_path=None if mmproj is None else str(mmproj),
        reranking=reranking,
    )
    process = engine.start_engine(engine.engine_command(settings, executable), log)

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited: {engine.last_output(log)}")
        return engine.health("127.0.0.1", settings.port, timeout=1) is None

    try:
        try:
            wait_for(healthy, timeout=ready_timeout, what="llama-server's /health to answer 200")
        except AssertionError as slow:
            raise RuntimeError(f"{slow}; its last output: {engine.last_output(log)}") from None
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        engine.stop_process_group(process.pid, child=process, grace=5)

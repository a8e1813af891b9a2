"""The node agent's settings, and their defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT_RANGE = (41000, 41999)
DEFAULT_HEARTBEAT_SECONDS = 2.0
DEFAULT_READY_TIMEOUT_SECONDS = 120.0
DEFAULT_ENGINE_LOG_MAX_BYTES = 10 * 1000 * 1000
# The agent's exit status once the control plane said its node was removed: EX_CONFIG of
# sysexits.h, which no other exit of the agent uses. Its systemd unit names it in
# RestartPreventExitStatus= (contrib/systemd/llmgw-node.service): restarting it would only
# hear the same answer again.
REMOVED_EXIT_STATUS = 78


@dataclass
class NodeConfig:
    server: str
    token: str
    memory_gb: float
    cores: int
    # Declared GPUs (--gpus/--gpu-memory), which replace detection; None: detect them.
    gpus: int | None = None
    gpu_memory_gb: float | None = None
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE
    cache: Path = field(default_factory=lambda: default_cache_dir())
    address: str = "127.0.0.1"
    heartbeat_interval: float = DEFAULT_HEARTBEAT_SECONDS
    ready_timeout: float = DEFAULT_READY_TIMEOUT_SECONDS
    stop_engines_on_exit: bool = False
    # The control plane says the node was removed (410): the agent stops its engines and exits
    # with REMOVED_EXIT_STATUS; this leaves them running instead.
    keep_engines_when_removed: bool = False
    engine: str | None = None  # llama-server's path; None: engine.find_engine()
    cache_max_gb: float | None = None  # None: the blob cache is not bounded
    engine_log_max_bytes: int = DEFAULT_ENGINE_LOG_MAX_BYTES
    # Other control planes of the same installation (the same database), tried in this order
    # after `server` when the one in use does not answer; the first that answers is used from
    # then on.
    more_servers: tuple[str, ...] = ()


def default_cache_dir() -> Path:
    # Absolute, so that an agent restarted from another directory still finds (and adopts)
    # the engines the earlier one left running.
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw" / "node"

"""llama-server's functions under their old names, for the callers that import them from here.

The engine code lives in llmgw.engines: the contract (``base``), the process handling every
engine shares (``process``) and llama-server's backend (``llamacpp``). New code asks
``llmgw.engines.get_engine(name)`` instead, so that it works for every engine. No Django.
"""

from __future__ import annotations

import os  # noqa: F401  (tests replace os.truncate through this module's name)

from llmgw.engines.base import (
    AdapterEntry,
    EngineSettings,
    NotReady,
    health,
    key_headers,
)
from llmgw.engines.llamacpp import (
    DEFAULT_CONTEXT_LENGTH,
    ENGINE_ENV,
    ENGINE_NAME,
    LIST_DEVICES_MAX_BYTES,
    LIST_DEVICES_TIMEOUT_SECONDS,
    MAX_BACKENDS,
    METRIC_NAMES,
    OFFLOAD_LOG_MAX_BYTES,
    BadAdapterPath,
    OffloadReport,
    check_ready,
    engine_backends,
    engine_command,
    engine_environment,
    find_engine,
    lora_request,
    offload_problem,
    offload_report,
    parse_backends,
    parse_metrics,
    read_metrics,
    serving_context,
)
from llmgw.engines.process import (
    LAST_OUTPUT_LINES,
    STOP_GRACE_SECONDS,
    last_output,
    port_is_free,
    process_alive,
    process_cmdline,
    read_log_from,
    rotate_log,
    run_bounded,
    start_engine,
    stop_process_group,
)

__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "ENGINE_ENV",
    "ENGINE_NAME",
    "LAST_OUTPUT_LINES",
    "LIST_DEVICES_MAX_BYTES",
    "LIST_DEVICES_TIMEOUT_SECONDS",
    "MAX_BACKENDS",
    "METRIC_NAMES",
    "OFFLOAD_LOG_MAX_BYTES",
    "STOP_GRACE_SECONDS",
    "AdapterEntry",
    "BadAdapterPath",
    "EngineSettings",
    "NotReady",
    "OffloadReport",
    "check_ready",
    "engine_backends",
    "engine_command",
    "engine_environment",
    "find_engine",
    "health",
    "key_headers",
    "last_output",
    "lora_request",
    "offload_problem",
    "offload_report",
    "parse_backends",
    "parse_metrics",
    "port_is_free",
    "process_alive",
    "process_cmdline",
    "read_log_from",
    "read_metrics",
    "rotate_log",
    "run_bounded",
    "serving_context",
    "start_engine",
    "stop_process_group",
]

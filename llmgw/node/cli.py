"""`llmgw node`: its options, grouped as `--help` shows them, and the start."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmgw.tracing import start_tracing

from .agent import Agent
from .config import (
    DEFAULT_ENGINE_LOG_MAX_BYTES,
    DEFAULT_HEARTBEAT_SECONDS,
    DEFAULT_PORT_RANGE,
    DEFAULT_READY_TIMEOUT_SECONDS,
    REMOVED_EXIT_STATUS,
    NodeConfig,
    default_cache_dir,
)

log = logging.getLogger("llmgw.node")


def add_parser(subparsers: Any) -> None:
    node = subparsers.add_parser(
        "node",
        help="run the node agent: fetch models and run their engines on this machine",
        description=(
            "Heartbeats this machine's capacity to the control plane and runs the replicas it "
            "answers with. Engines outlive the agent: a restarted agent adopts them. Stop it "
            "with SIGTERM or Ctrl-C."
        ),
    )
    _add_control_plane_options(node.add_argument_group("the control plane"))
    _add_capacity_options(node.add_argument_group("what this machine offers"))
    _add_engine_options(node.add_argument_group("the engines"))
    _add_cache_options(node.add_argument_group("the cache"))


def _add_control_plane_options(group: Any) -> None:
    group.add_argument(
        "--server",
        action="append",
        metavar="URL",
        help=(
            "the control plane's URL (default: LLMGW_URL). With several control planes, give "
            "each (--server URL --server URL, or URLs separated by commas): the agent heartbeats "
            "to the first that answers and stays with it until it stops answering"
        ),
    )
    group.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=(
            "a file holding this node's token (given when the node was registered); without "
            "it the token is read from LLMGW_NODE_TOKEN. There is no --token: a command line "
            "is visible to every user of the machine in `ps`"
        ),
    )
    # Refused with a reason (rather than left unknown, which argparse would read as an
    # abbreviation of --token-file).
    group.add_argument("--token", help=argparse.SUPPRESS)
    group.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=DEFAULT_HEARTBEAT_SECONDS,
        metavar="S",
        help=(
            "seconds between heartbeats until the control plane's answer sets its own "
            "(default %(default)g)"
        ),
    )


def _add_capacity_options(group: Any) -> None:
    group.add_argument(
        "--memory",
        type=_positive_float,
        required=True,
        metavar="GB",
        help="host RAM the control plane may fill with replicas on this machine",
    )
    group.add_argument(
        "--cores",
        type=int,
        required=True,
        metavar="N",
        help="CPU cores the control plane may hand out to replicas on this machine",
    )
    group.add_argument(
        "--gpus",
        type=_gpu_count,
        default=None,
        metavar="N",
        help=(
            "declare N GPUs instead of detecting them (by default NVIDIA GPUs are found through "
            "NVML, else nvidia-smi, and their memory in use is reported every few seconds); for "
            "machines where neither works. --gpus 0 declares none, so no replica is placed on "
            "this machine's GPUs"
        ),
    )
    group.add_argument(
        "--gpu-memory",
        type=_positive_float,
        default=None,
        metavar="GB",
        help="memory of each declared GPU; needed with --gpus N above 0",
    )


def _add_engine_options(group: Any) -> None:
    group.add_argument(
        "--llama-server",
        metavar="PATH",
        default=None,
        help=(
            "the llama-server executable engines run (default: LLMGW_LLAMA_SERVER, else the one "
            "`make setup` builds beside this Python, else llama-server on PATH)"
        ),
    )
    group.add_argument(
        "--address",
        default="127.0.0.1",
        help=(
            "the address the gateway reaches this machine's engines at; engines listen on it "
            "(default 127.0.0.1, which only works when everything runs on one machine). The "
            "control plane takes only the address this agent connects from, or one staff allowed "
            "for the node (llmgw ctl node set NAME --address-allow); 0.0.0.0 listens everywhere "
            "and is reached where the agent connects from"
        ),
    )
    group.add_argument(
        "--port-range",
        type=_port_range,
        default=DEFAULT_PORT_RANGE,
        metavar="A-B",
        help=(
            "ports the engines may listen on (default {}-{}); sent to the control plane, which "
            "routes to no replica outside them".format(*DEFAULT_PORT_RANGE)
        ),
    )
    group.add_argument(
        "--ready-timeout",
        type=_positive_float,
        default=DEFAULT_READY_TIMEOUT_SECONDS,
        metavar="S",
        help=(
            "seconds an engine has to answer a completion after it starts before it is "
            "stopped and its replica failed (default %(default)g)"
        ),
    )
    group.add_argument(
        "--engine-log-max-mb",
        type=_positive_float,
        default=DEFAULT_ENGINE_LOG_MAX_BYTES / 1e6,
        metavar="MB",
        help=(
            "past this size an engine's log is moved to engine.log.1 and started afresh "
            "(default %(default)g)"
        ),
    )
    group.add_argument(
        "--stop-engines-on-exit",
        action="store_true",
        help=(
            "stop the engines when the agent exits; by default they keep serving and the next "
            "agent adopts them"
        ),
    )
    group.add_argument(
        "--keep-engines-when-removed",
        action="store_true",
        help=(
            "when the control plane says this node was removed, leave its engines running "
            "(the gateway no longer sends them requests) instead of stopping them; the agent "
            f"exits with status {REMOVED_EXIT_STATUS} in both cases"
        ),
    )


def _add_cache_options(group: Any) -> None:
    group.add_argument(
        "--cache",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "where weights and replica state are kept (default $XDG_CACHE_HOME/llmgw/node, "
            "else ~/.cache/llmgw/node); a restarted agent must use the same one to adopt "
            "its engines"
        ),
    )
    group.add_argument(
        "--cache-max-gb",
        type=_positive_float,
        default=None,
        metavar="GB",
        help=(
            "bound the weights kept in the cache: past it, the least recently used files that "
            "no replica here needs and that are not a previous revision (kept for a rollback) "
            "are deleted (default: unbounded)"
        ),
    )


def _port_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)-(\d+)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range like 41000-41999")
    low, high = int(match.group(1)), int(match.group(2))
    if not 1 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r}: ports go from 1 to 65535, the first no higher than the last"
        )
    return low, high


def _gpu_count(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{text} is not a number of GPUs from 0 to 64")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    # Its calls to the control plane, when OTEL_EXPORTER_OTLP_ENDPOINT is set (llmgw.tracing).
    start_tracing("llmgw-node", ("requests",))
    with _logging_to_stderr():
        agent = Agent(config)
        signal.signal(signal.SIGTERM, agent.request_shutdown)
        signal.signal(signal.SIGINT, agent.request_shutdown)
        return agent.run()


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    servers = [
        url.strip()
        for given in (args.server or [os.environ.get("LLMGW_URL") or ""])
        for url in given.split(",")
        if url.strip()
    ]
    if not servers:
        raise SystemExit("llmgw node: give the control plane's URL with --server (or LLMGW_URL).")
    token = _token(args)
    if args.gpu_memory is not None and args.gpus is None:
        raise SystemExit(
            "llmgw node: --gpu-memory goes with --gpus N (the GPUs it describes); without "
            "--gpus the GPUs and their memory are detected."
        )
    if args.gpus and args.gpu_memory is None:
        raise SystemExit(
            f"llmgw node: --gpus {args.gpus} needs --gpu-memory GB, the memory of each GPU."
        )
    return NodeConfig(
        server=servers[0],
        more_servers=tuple(dict.fromkeys(servers[1:])),
        token=token,
        memory_gb=args.memory,
        cores=args.cores,
        gpus=args.gpus,
        gpu_memory_gb=args.gpu_memory,
        port_range=args.port_range,
        cache=(args.cache or default_cache_dir()).expanduser().absolute(),
        address=args.address,
        heartbeat_interval=args.heartbeat_interval,
        ready_timeout=args.ready_timeout,
        stop_engines_on_exit=args.stop_engines_on_exit,
        keep_engines_when_removed=args.keep_engines_when_removed,
        engine=args.llama_server,
        cache_max_gb=args.cache_max_gb,
        engine_log_max_bytes=int(args.engine_log_max_mb * 1e6),
    )


def _token(args: argparse.Namespace) -> str:
    if args.token is not None:
        raise SystemExit(
            "llmgw node: --token is not taken: a command line is visible to every user of the "
            "machine (ps). Put the token in LLMGW_NODE_TOKEN or in a file named by --token-file."
        )
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise SystemExit(
                f"llmgw node: cannot read the token file {args.token_file}: {exc.strerror or exc}."
            ) from None
        if not token:
            raise SystemExit(f"llmgw node: the token file {args.token_file} is empty.")
        return token
    token = os.environ.get("LLMGW_NODE_TOKEN", "").strip()
    if not token:
        raise SystemExit(
            "llmgw node: give this node's token in LLMGW_NODE_TOKEN or in a file named by "
            "--token-file; the control plane gives one when the node is registered."
        )
    return token


@contextlib.contextmanager
def _logging_to_stderr() -> Iterator[None]:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s llmgw node: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)

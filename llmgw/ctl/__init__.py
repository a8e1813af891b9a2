"""`llmgw ctl`: the catalog from the command line, through the REST API.

Every command that changes something prints what is now in force (as the
control plane reports it, not the request echoed back) and when it takes
effect; every read command has --json. Each module holds a group of commands,
and each command's parser sits beside the function that runs it; this module
puts them together in the order `--help` lists them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmgw.client import Client, CtlError

from . import audit, canary, gateway, login, models, nodes, teams, traffic, updates


def add_parser(subparsers: Any) -> None:
    ctl = subparsers.add_parser(
        "ctl",
        help="manage the catalog through the control plane's API",
        description="Talks to the control plane at LLMGW_URL with the API token in LLMGW_TOKEN, "
        "else the one `llmgw ctl login` kept for it.",
    )
    ctl.add_argument(
        "--url", help="the control plane (default: LLMGW_URL, else http://127.0.0.1:8000)"
    )
    ctl.add_argument(
        "--token",
        help="an API token (default: LLMGW_TOKEN, else the one `llmgw ctl login` kept)",
    )
    sub = ctl.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in (
        login.add_login,
        models.add_models,
        models.add_scale,
        audit.add_audit,
        nodes.add_nodes,
        nodes.add_node,
        models.add_restart,
        gateway.add_keys,
        gateway.add_key,
        gateway.add_usage,
        teams.add_teams,
        teams.add_team,
        _add_model,
    ):
        add_command(sub)


def _add_model(sub: Any) -> None:
    model = sub.add_parser("model", help="add, remove and change models while the cluster runs")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    for add_command in (
        models.add_model_add,
        models.add_model_target,
        models.add_model_plan,
        updates.add_model_serve,
        updates.add_model_updates,
        updates.add_model_update,
        updates.add_model_rollback,
        canary.add_model_canary,
        models.add_model_show,
        traffic.add_model_traffic,
        models.add_model_remove,
        models.add_model_resources,
        models.add_model_class,
        models.add_model_autoscale,
        models.add_model_owner,
        models.add_model_adapters,
    ):
        add_command(msub)


def run(args: argparse.Namespace) -> int:
    client = Client(url=args.url, token=args.token)
    try:
        args.run(client, args)
    except CtlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0

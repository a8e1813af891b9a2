"""`llmgw ctl nodes` and `llmgw ctl node`: the fleet's nodes; adding, removing and cordoning them."""

from __future__ import annotations

import argparse
from typing import Any

from llmgw.client import Client

from .output import table, table_wanted


def add_nodes(sub: Any) -> None:
    p = sub.add_parser(
        "nodes", help="the nodes: capacity, reserved, free, replicas, last heartbeat"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_nodes)


def cmd_nodes(client: Client, args: argparse.Namespace) -> None:
    nodes = client.get("nodes")
    if not table_wanted(args, nodes, "No nodes yet. Add one with: llmgw ctl node add NAME"):
        return

    def figures(r: dict[str, Any]) -> str:
        text = f"{r['memory_gb']:g} GB, {r['cores']:g} cores"
        return text + (f", {r['gpus']} GPUs" if r["gpus"] else "")

    rows = [
        [
            n["name"],
            n["state"],
            figures(n["capacity"]),
            figures(n["reserved"]),
            figures(n["free"]),
            str(len(n["replicas"])),
            (n["last_heartbeat"] or "never")[:19].replace("T", " "),
        ]
        for n in nodes
    ]
    print(
        table(
            rows,
            ["NAME", "STATE", "CAPACITY", "RESERVED", "FREE", "REPLICAS", "LAST HEARTBEAT (UTC)"],
        )
    )


def add_node(sub: Any) -> None:
    node = sub.add_parser("node", help="add, remove, cordon and uncordon nodes (staff)")
    nsub = node.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
    p = nsub.add_parser("add", help="register a node and print its token (shown only once)")
    p.add_argument("name")
    p.set_defaults(run=cmd_node_add)
    p = nsub.add_parser("remove", help="forget a node; its replicas are placed elsewhere")
    p.add_argument("name")
    p.set_defaults(run=cmd_node_remove)
    for verb, text in (
        ("cordon", "keep what a node runs, but place nothing new on it"),
        ("uncordon", "let a cordoned node take new replicas again"),
    ):
        p = nsub.add_parser(verb, help=text)
        p.add_argument("name")
        p.set_defaults(run=cmd_node_cordon)


def cmd_node_add(client: Client, args: argparse.Namespace) -> None:
    node = client.post("nodes", {"name": args.name})
    print(f"Node {node['name']} added. Its token is shown only now:\n\n  {node['token']}\n")
    print("Run the agent on that machine with:")
    print(f"  llmgw node --server {client.url} --token {node['token']} --memory GB --cores N")


def cmd_node_remove(client: Client, args: argparse.Namespace) -> None:
    client.delete(f"nodes/{args.name}")
    print(f"Node {args.name} removed; its replicas are placed elsewhere on the next pass.")


def cmd_node_cordon(client: Client, args: argparse.Namespace) -> None:
    action = "cordon" if args.node_command == "cordon" else "uncordon"
    node = client.post(f"nodes/{args.name}/{action}", None)
    if node["cordoned"]:
        print(f"Node {node['name']} is cordoned: it keeps its replicas but gets no new ones.")
    else:
        print(f"Node {node['name']} takes new replicas again ({node['state']}).")

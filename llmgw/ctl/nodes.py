"""`llmgw ctl nodes` and `llmgw ctl node`: the fleet's nodes; adding, removing and cordoning them."""

from __future__ import annotations

import argparse
from typing import Any

from llmgw.client import Client

from .commands import command
from .output import program, table, table_wanted


def add_nodes(sub: Any) -> None:
    p = command(
        sub, "nodes", "the nodes: capacity, reserved, free, replicas, last heartbeat", run=cmd_nodes
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_nodes(client: Client, args: argparse.Namespace) -> None:
    nodes = client.get("nodes")
    if not table_wanted(args, nodes, f"No nodes yet. Add one with: {program()} ctl node add NAME"):
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
    _print_devices(nodes)
    # Capacity a node reports and is not believed: CAPACITY above is what placement counts on.
    for warning in (w for n in nodes for w in n.get("warnings") or []):
        print(warning)


def _print_devices(nodes: list[dict[str, Any]]) -> None:
    """Each GPU's memory: what llmgw reserved, what other programs use, and what is free."""
    rows = [
        [
            n["name"],
            str(d["index"]),
            d["name"] or "-",
            f"{d['memory_total_gb']:g} GB",
            f"{d['reserved_gb']:g} GB",
            f"{d['used_by_others_gb']:g} GB",
            f"{d['free_gb']:g} GB",
            "-" if d.get("utilization_pct") is None else f"{d['utilization_pct']}%",
        ]
        for n in nodes
        for d in n.get("devices") or []
    ]
    if rows:
        print()
        headers = ["NODE", "GPU", "NAME", "MEMORY", "LLMGW", "OTHERS", "FREE", "BUSY"]
        print(table(rows, headers))
    for n in nodes:
        backends = n.get("engine_backends") or []
        if n.get("devices") and backends and all(b == "CPU" for b in backends):
            print(
                f"Node {n['name']} has GPUs but its engine is built for the CPU only: no replica "
                "with GPUs is placed there until it runs a GPU build (make setup "
                "LLMGW_ENGINE=cuda on that machine, then restart its agent)."
            )


def add_node(sub: Any) -> None:
    node = command(sub, "node", "add, change, remove, cordon and uncordon nodes (staff)")
    nsub = node.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
    for verb, text, run, required in (
        ("add", "register a node and print its token (shown only once)", cmd_node_add, False),
        (
            "set",
            "change the networks a node may report as its engines' address",
            cmd_node_set,
            True,
        ),
    ):
        p = command(nsub, verb, text, run=run)
        p.add_argument("name")
        _address_allow_option(p, required=required)
    p = command(
        nsub,
        "accept-capacity",
        "believe the memory, cores and GPUs a node reports, above what it first registered",
        "A node is believed up to the capacity it first reported; after giving its machine "
        "more, restart its agent with the new figures and accept them with this. The "
        "figures now in force are printed.",
        run=cmd_node_accept_capacity,
    )
    p.add_argument("name")
    p = command(
        nsub, "remove", "forget a node; its replicas are placed elsewhere", run=cmd_node_remove
    )
    p.add_argument("name")
    for verb, text in (
        ("cordon", "keep what a node runs, but place nothing new on it"),
        ("uncordon", "let a cordoned node take new replicas again"),
    ):
        p = command(nsub, verb, text, run=cmd_node_cordon)
        p.add_argument("name")


def _address_allow_option(parser: Any, *, required: bool) -> None:
    parser.add_argument(
        "--address-allow",
        metavar="CIDR[,CIDR]",
        required=required,
        type=_networks,
        default=[],
        help=(
            "networks (or addresses) the node may report as its engines' address besides the "
            "one it connects from: for a node behind NAT, or whose engines listen on another "
            "interface than the one it reaches the control plane from"
            + ("; '' clears the list" if required else "")
        ),
    )


def _networks(text: str) -> list[str]:
    # Checked by the control plane, which says what is wrong with an entry.
    return [item.strip() for item in text.split(",") if item.strip()]


def _allowed_words(node: dict[str, Any]) -> str:
    allowed = node.get("address_allow") or []
    return ", ".join(allowed) if allowed else "only the address it connects from"


def cmd_node_add(client: Client, args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"name": args.name}
    if args.address_allow:
        body["address_allow"] = args.address_allow
    node = client.post("nodes", body)
    print(f"Node {node['name']} added. Its token is shown only now:\n\n  {node['token']}\n")
    if args.address_allow:
        print(
            f"It may report its engines at: {', '.join(args.address_allow)}, or where it connects from."
        )
    print(
        "Run the agent on that machine with the token in its environment (not on its command line):"
    )
    print(
        f"  LLMGW_NODE_TOKEN={node['token']} {program()} node --server {client.url} "
        "--memory GB --cores N --address ITS_IP"
    )


def cmd_node_set(client: Client, args: argparse.Namespace) -> None:
    node = client.request("PATCH", f"nodes/{args.name}", json={"address_allow": args.address_allow})
    print(f"Node {node['name']} may report its engines at: {_allowed_words(node)}.")
    print("Its next heartbeat is checked against this.")


def cmd_node_accept_capacity(client: Client, args: argparse.Namespace) -> None:
    node = client.post(f"nodes/{args.name}/accept-capacity", None)
    capacity = node["capacity"]
    text = f"{capacity['memory_gb']:g} GB, {capacity['cores']:g} cores"
    if capacity["gpus"]:
        text += f", {capacity['gpus']} GPUs of {capacity['gpu_memory_gb']:g} GB"
    print(f"Node {node['name']}: placement now counts on {text}, as it reports.")


def cmd_node_remove(client: Client, args: argparse.Namespace) -> None:
    client.delete(f"nodes/{args.name}")
    print(
        f"Node {args.name} removed; its replicas are placed elsewhere on the next pass. Its "
        "agent, at its next heartbeat, stops its engines and exits (status 78; "
        "--keep-engines-when-removed leaves them running)."
    )


def cmd_node_cordon(client: Client, args: argparse.Namespace) -> None:
    action = "cordon" if args.node_command == "cordon" else "uncordon"
    node = client.post(f"nodes/{args.name}/{action}", None)
    if node["cordoned"]:
        print(f"Node {node['name']} is cordoned: it keeps its replicas but gets no new ones.")
    else:
        print(f"Node {node['name']} takes new replicas again ({node['state']}).")

"""What the control plane believes of a node's heartbeat: where its engines are, on which ports,
and how much the node has.

A node token is a credential like any other: a stolen or mistyped one must not point the
gateway at another machine's services (which would relay whatever answers there to clients) or
draw replicas onto capacity that does not exist. Three rules, checked on every heartbeat: the
address (engine_address), the ports (port_range, replica_port_problem) and the capacity
(check_limits, believed); docs/security.md#nodes gives them as operators meet them. Pure
functions, so that the rules can be read, and tested, apart from the database.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from llmgw.node.config import DEFAULT_PORT_RANGE

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# A node behind NAT needs one network or a few; a bound keeps the list readable in the admin.
MAX_ALLOWED_NETWORKS = 32


class Untrusted(Exception):
    """A report the control plane does not believe; the message says why and what to do."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# -- 1. the address -------------------------------------------------------------------------------


def parse_ip(text: str) -> IPAddress | None:
    """An IP address, IPv4-mapped IPv6 read as the IPv4 it carries; None if `text` is none."""
    try:
        address = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_networks(entries: list[str]) -> list[str]:
    """Staff's allow-list, each entry a network (CIDR) or one address, in canonical form;
    ValueError with the entry that is neither."""
    if len(entries) > MAX_ALLOWED_NETWORKS:
        raise ValueError(f"at most {MAX_ALLOWED_NETWORKS} networks, not {len(entries)}")
    networks: list[str] = []
    for entry in entries:
        try:
            # strict=False: 10.0.0.5/24 means the network 10.0.0.5 is in, as people write it.
            network = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise ValueError(
                f"{entry!r} is not a network like 10.0.0.0/24 or an address like 10.0.0.5"
            ) from None
        if str(network) not in networks:
            networks.append(str(network))
    return networks


def engine_address(
    *,
    reported: str,
    peer: str,
    allowed: list[str],
    node: str,
    on_this_machine: Callable[[IPAddress], bool] = lambda ip: ip.is_loopback,
) -> str:
    """Where the gateway reaches the node's engines; Untrusted if the report is not believed.

    The engines are at the address the node connects from, or at an address staff allowed for
    it (a node behind NAT, or with one interface for the control plane and another for the
    gateway). A node that reports no address, or the unspecified one (0.0.0.0, ::), is reached
    where it connects from. A loopback address is taken only from a node that connects from an
    address of the control plane's own machine, which assumes, as the run command does, that the
    gateway runs on that machine too. Anything else is refused whole.

    `peer` is the address the heartbeat came from (REMOTE_ADDR), `allowed` the networks staff
    registered for the node. `on_this_machine` says whether a peer is an address of the control
    plane's own machine: a node there that reaches the control plane by its public name
    connects from that address, and its loopback engines are as local as the gateway's.
    """
    seen = parse_ip(peer)
    if not reported.strip():
        claimed: IPAddress | None = None
    else:
        claimed = parse_ip(reported)
        if claimed is None:
            # Why: a name can resolve to another machine tomorrow (or per request), so it
            # cannot be checked against where the node connects from.
            raise Untrusted(
                f"This node reports its engines at {reported[:100]!r}, which is not an IP "
                "address; a host name cannot be checked against where the node connects from. "
                "Start its agent with --address set to the IP address the gateway reaches it at.",
                code="address_not_ip",
            )
    # The unspecified address: engines listen on every interface; reach them where the node is.
    if claimed is None or claimed.is_unspecified:
        if seen is None:
            raise Untrusted(
                "The control plane cannot tell which address this node connects from, so it "
                "cannot take an unspecified one. Start its agent with --address set to its IP "
                f"address, and have staff allow it: llmgw ctl node set {node} --address-allow "
                "ADDRESS.",
                code="address_unknown",
            )
        return str(seen)
    if seen is not None and claimed == seen:
        return str(claimed)
    if seen is not None and claimed.is_loopback and on_this_machine(seen):
        return str(claimed)
    if any(claimed in ipaddress.ip_network(network) for network in allowed):
        return str(claimed)
    where = f"connects from {seen}" if seen is not None else "connects from an unknown address"
    allowed_text = ", ".join(allowed) if allowed else "none"
    remedy = (
        f"Start its agent with --address {seen} (or 0.0.0.0, to be reached where it connects from)"
        if seen is not None and not seen.is_loopback
        else "Start its agent with --address set to the address it connects from"
    )
    raise Untrusted(
        f"This node reports its engines at {claimed}, but it {where} and {claimed} is in none "
        f"of the networks staff allowed for it ({allowed_text}); the gateway sends requests "
        f"only to a node's own address. {remedy}, or, for a node behind NAT or with several "
        f"interfaces, have staff allow that address: llmgw ctl node set {node} "
        f"--address-allow {claimed}.",
        code="address_not_allowed",
    )


# -- 2. the ports ---------------------------------------------------------------------------------


def port_range(*, declared: dict[str, int] | None, bounds: tuple[int, int]) -> tuple[int, int]:
    """The node's engine ports: what it declares (its agent's --port-range, or the agent's
    default when it declares none), within the operator's bounds."""
    first, last = (declared["first"], declared["last"]) if declared else DEFAULT_PORT_RANGE
    low, high = bounds
    if first > last:
        raise Untrusted(
            f"This node declares the ports {first}-{last}, whose first is above its last. "
            "Give its agent a --port-range like 41000-41999.",
            code="port_range_invalid",
        )
    if first < low or last > high:
        raise Untrusted(
            f"This node declares the ports {first}-{last} for its engines, but nodes may use "
            f"only {low}-{high} here (LLMGW_NODE_PORT_MIN, LLMGW_NODE_PORT_MAX). Start its agent "
            f"with a --port-range within {low}-{high}.",
            code="port_range_not_allowed",
        )
    return first, last


def replica_port_problem(port: int, *, first: int, last: int, reserved: set[int]) -> str | None:
    """Why the gateway must not send requests to a replica reported on `port`, or None."""
    if not first <= port <= last:
        return (
            f"its node reported it on port {port}, outside the ports {first}-{last} the node "
            "declared for its engines; it is not routed"
        )
    if port in reserved:
        return (
            f"its node reported it on port {port}, where the control plane itself listens on "
            "that machine; it is not routed"
        )
    return None


# -- 3. the capacity ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    memory_gb: float
    cores: float
    gpus: int
    gpu_memory_gb: float  # of each GPU

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Capacity:
        return cls(
            memory_gb=float(data.get("memory_gb") or 0),
            cores=float(data.get("cores") or 0),
            gpus=int(data.get("gpus") or 0),
            gpu_memory_gb=float(data.get("gpu_memory_gb") or 0),
        )

    def as_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def words(self) -> dict[str, str]:
        return {
            "memory_gb": f"{self.memory_gb:g} GB of memory",
            "cores": f"{self.cores:g} cores",
            "gpus": f"{self.gpus} GPUs",
            "gpu_memory_gb": f"{self.gpu_memory_gb:g} GB per GPU",
        }


# The settings that bound each figure, named in refusals.
LIMIT_SETTINGS = {
    "memory_gb": "LLMGW_NODE_MAX_MEMORY_GB",
    "cores": "LLMGW_NODE_MAX_CORES",
    "gpus": "LLMGW_NODE_MAX_GPUS",
    "gpu_memory_gb": "LLMGW_NODE_MAX_GPU_MEMORY_GB",
}


def check_limits(reported: Capacity, limits: Capacity) -> None:
    """Untrusted when a figure is above the operator's limit for one node.

    Why refused whole rather than cut down to the limit: a figure that large is a typo or a lie,
    and the rest of such a report is no better; the node stays out of placement until it
    reports figures a machine can have.
    """
    said, most = reported.words(), limits.words()
    over = [
        f"{said[name]} (at most {most[name]}, {LIMIT_SETTINGS[name]})"
        for name in LIMIT_SETTINGS
        if getattr(reported, name) > getattr(limits, name)
    ]
    if over:
        raise Untrusted(
            f"This node reports {', '.join(over)}: more than this control plane takes from one "
            "node. Start its agent with the machine's real figures (--memory, --cores, --gpus, "
            "--gpu-memory), or have the operator raise the limit.",
            code="capacity_over_limit",
        )


def believed(reported: Capacity, registered: Capacity) -> tuple[Capacity, list[str]]:
    """What placement may count on, and a sentence for each figure not believed.

    The rule: each figure is believed up to what the node first registered with. Less is always
    believed: a machine that gave memory to other work or lost a GPU is safe to under-fill. More
    needs staff to accept it (node_accept_capacity): the agent takes its figures from its command
    line, so an honest node reports the same ones every time, and a larger one is either a person's
    decision (a bigger machine), which another person confirms, or a token used to draw every
    replica to one place, where they would fail or swap. No margin either: the figures do not
    drift on their own, so a margin would only be room for a lie.
    """
    figures: dict[str, Any] = {}
    notes: list[str] = []
    said, first = reported.words(), registered.words()
    for name in LIMIT_SETTINGS:
        now, then = getattr(reported, name), getattr(registered, name)
        figures[name] = min(now, then)
        if now > then:
            notes.append(
                f"reports {said[name]}, more than the {first[name]} it registered with; "
                f"placement counts on {first[name]} until staff accept more"
            )
    return Capacity(**figures), notes

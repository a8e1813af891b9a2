"""`llmgw ctl`: the catalog from the command line, through the REST API.

Every command that changes something prints what is now in force (as the
control plane reports it, not the request echoed back) and when it takes
effect; every read command has --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import ctl_gateway
from .client import Client, CtlError
from .units import format_bytes

SCALING_HELP = """\
The replica count is --min. --max is a ceiling, not a target: a model with a
minimum runs exactly that many, and nothing grows it under load. Leave --max
out and it follows --min.

--min 0 with --max above 0 makes the model on demand: nothing runs until a
request asks for it, then one replica is loaded (one, however high --max is),
and it is stopped again once nobody has asked for the idle timeout. An idle
timeout of 0 takes the cluster's default. --min 0 --max 0 keeps the model in
the catalog, deliberately not running.

Only models added at runtime can be scaled here. A model declared in
server.yaml is read again on every start, so a number set here would revert
then; change it in the file instead.

It takes effect on the reconciler's next pass, and survives restarts."""

CLASS_HELP = """\
When a model cannot be placed, replicas of a lower class are stopped to make
room for it:
  critical       never gives up the replicas of its minimum
  standard       gives way to critical
  opportunistic  gives way to both
Within one class, a model below its minimum may take what another model grew
into beyond its own minimum, but never that model's minimum. "default" goes
back to what the scaling implies: opportunistic for an on-demand model,
standard otherwise."""

RESOURCES_HELP = """\
--memory is the host RAM one replica reserves on its node (weights, KV cache
and engine together, for a model without a GPU). A node holds only as many
replicas as it has memory for.

--cores is the CPU cores one replica reserves; it also becomes the engine's
thread count, so replicas on one node do not compete for the same cores.
0 reserves none and leaves the thread count to the node.

Running replicas keep the figures they were started with until they are
restarted (llmgw ctl restart --model MODEL)."""

ADAPTERS_HELP = """\
An adapter is asked for by its NAME as though it were a model, and is served
by this model's replicas with the adapter applied. URL is the adapter file,
usually in the mirror; it must be a GGUF LoRA adapter made for this model's
architecture, which is checked before it is stored. --remove runs before
--add, so --remove X --add X=URL replaces X. Replicas load a changed set when
they restart (llmgw ctl restart --model MODEL)."""


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _scaling_text(view: dict[str, Any]) -> str:
    s = view["scaling"]
    if s["parked"]:
        return "not running (min 0, max 0)"
    if s["on_demand"]:
        return f"on demand (up to {s['max']}, idle {s['idle_timeout']})"
    return f"{s['min']} (max {s['max']})"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


# -- commands -------------------------------------------------------------------


def cmd_models(client: Client, args: argparse.Namespace) -> None:
    models = client.get("models")
    if args.json:
        _print_json(models)
        return
    if not models:
        print("No models yet. Add one with: llmgw ctl model add -f model.yaml")
        return
    rows = [
        [
            m["name"],
            f"{m['ready']}/{m['desired']}",
            m["kind"],
            m["owner"] or "-",
            m["class"],
            _scaling_text(m),
            "replacement halted" if m.get("rollout_halted") else "",
        ]
        for m in models
    ]
    print(_table(rows, ["NAME", "READY", "KIND", "OWNER", "CLASS", "SCALING", "NOTE"]))


def cmd_model_show(client: Client, args: argparse.Namespace) -> None:
    view = client.get(f"models/{args.name}")
    if args.json:
        _print_json(view)
        return
    import yaml

    print(
        f"# {view['name']}: {view['kind']}, owner {view['owner'] or '-'}, class {view['class']}, "
        f"replicas {_scaling_text(view)}"
    )
    print(yaml.safe_dump(view["definition"], sort_keys=False).rstrip())


def cmd_model_add(client: Client, args: argparse.Namespace) -> None:
    path = Path(args.file)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror}") from None
    params = {} if not args.no_source_check else {"source_check": "false"}
    try:
        view = client.request(
            "POST", "models", data=text, content_type="application/yaml", params=params
        )
    except CtlError as exc:
        raise CtlError(f"{path}: {exc}") from None
    if view.get("source_size_text"):
        print(f"Source is there: {view['source_size_text']} at {view['definition']['source']}")
    print(
        f"{view['name']} added, owned by {view['owner']}; class {view['class']}; replicas {_scaling_text(view)}."
    )
    print("It is placed on the reconciler's next pass; watch it with: llmgw ctl models")


def cmd_model_remove(client: Client, args: argparse.Namespace) -> None:
    client.delete(f"models/{args.name}")
    print(
        f"{args.name} removed. Its replicas are withdrawn from routing, then stopped, on the next pass."
    )


def cmd_scale(client: Client, args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"min": args.min, "max": args.max}
    if args.idle_timeout is not None:
        body["idle_timeout"] = args.idle_timeout
    view = client.post(f"models/{args.name}/scale", body)
    s = view["scaling"]
    if s["parked"]:
        print(f"{view['name']} will not be placed; it stays in the catalog (min 0, max 0).")
    elif s["on_demand"]:
        print(
            f"{view['name']} is on demand: one replica is loaded when asked for (max {s['max']}), "
            f"and stopped after {s['idle_timeout']} without requests."
        )
    else:
        follows = ", following min" if s["max_follows_min"] else ""
        print(
            f"{view['name']}: {s['min']} replica(s) (max {s['max']}{follows}). It takes effect on the next pass."
        )
    print("Watch it with: llmgw ctl models")


def cmd_model_resources(client: Client, args: argparse.Namespace) -> None:
    body = {"memory_gb": args.memory, "cores": args.cores, "profile": args.profile}
    view = client.post(f"models/{args.name}/resources", body)
    for p in view["definition"]["profiles"]:
        print(
            f"{view['name']}/{p['name']}: {p['memory_gb']:g} GB memory, {p['cores']:g} cores, {p['gpus']} GPUs"
        )
    print(
        f"Running replicas keep their old figures until restarted: llmgw ctl restart --model {view['name']}"
    )


def cmd_model_class(client: Client, args: argparse.Namespace) -> None:
    view = client.post(f"models/{args.name}/class", {"class": args.klass})
    how = "set explicitly" if view["class_set"] != "default" else "the default for its scaling"
    print(f"{view['name']} is {view['class']} ({how}). It applies from the next pass.")


def cmd_model_owner(client: Client, args: argparse.Namespace) -> None:
    view = client.post(f"models/{args.name}/owner", {"owner": args.user})
    print(f"{view['name']} is now owned by {view['owner']}.")


def _parse_adapter(spec: str) -> dict[str, Any]:
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise CtlError(f"--add {spec!r} is not NAME=URL[@SCALE]")
    adapter: dict[str, Any] = {"name": name, "source": rest}
    head, at, tail = rest.rpartition("@")
    if at and head:
        try:
            adapter["scale"] = float(tail)
            adapter["source"] = head
        except ValueError:
            pass  # an '@' that is part of the URL
    return adapter


def cmd_model_adapters(client: Client, args: argparse.Namespace) -> None:
    if not args.add and not args.remove:
        adapters = client.get(f"models/{args.name}/adapters")
    else:
        body = {"add": [_parse_adapter(s) for s in args.add], "remove": args.remove}
        params = {"source_check": "false"} if args.no_source_check else {}
        adapters = client.post(f"models/{args.name}/adapters", body, **params)
    if args.json:
        _print_json(adapters)
        return
    if not adapters:
        print(f"{args.name} has no adapters.")
    for a in adapters:
        print(f"{a['name']}\tscale {a['scale']:g}\t{a['source']}")
    if args.add or args.remove:
        print(
            f"{args.name} serves {len(adapters)} adapter(s); replicas load them when restarted: "
            f"llmgw ctl restart --model {args.name}"
        )


def cmd_audit(client: Client, args: argparse.Namespace) -> None:
    page = client.get(
        "audit", model=args.model, actor=args.actor, action=args.action, limit=args.limit
    )
    entries = page["entries"]
    if args.json:
        _print_json(entries)
        return
    if not entries:
        print("No audit entries match.")
        return
    rows = []
    for e in entries:
        changed = ", ".join(
            f"{k}: {_short(v[0])} -> {_short(v[1])}" for k, v in e["changes"].items()
        )
        if e["action"] in ("add", "remove"):
            changed = e["note"] or ""
        rows.append(
            [
                e["at"][:19].replace("T", " "),
                e["actor"],
                e["door"],
                e["action"],
                e["model"],
                changed or e["note"],
            ]
        )
    print(_table(rows, ["WHEN (UTC)", "ACTOR", "DOOR", "ACTION", "MODEL", "CHANGE"]))


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def cmd_nodes(client: Client, args: argparse.Namespace) -> None:
    nodes = client.get("nodes")
    if args.json:
        _print_json(nodes)
        return
    if not nodes:
        print("No nodes yet. Add one with: llmgw ctl node add NAME")
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
        _table(
            rows,
            ["NAME", "STATE", "CAPACITY", "RESERVED", "FREE", "REPLICAS", "LAST HEARTBEAT (UTC)"],
        )
    )


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


def cmd_restart(client: Client, args: argparse.Namespace) -> None:
    result = client.post(f"models/{args.model}/restart", None)
    print(
        f"{result['model']} restarts, one replica at a time: each new replica must be ready before an "
        f"old one is withdrawn (generation {result['generation']}). Watch it with: llmgw ctl model target {result['model']}"
    )


def _print_target(target: dict[str, Any]) -> None:
    print(
        f"{target['model']}: {target['ready']} ready of {target['desired']} wanted ({target['why']}); class {target['class']}"
    )
    if target.get("rollout_halted"):
        print(f"  replacement {target['rollout_halted']}")
    for r in target["replicas"]:
        extra = "" if r["up_to_date"] else " (out of date)"
        detail = r["withdraw_reason"] if r["state"] == "withdrawn" else r["message"]
        port = f":{r['port']}" if r["port"] else ""
        print(f"  {r['node']}{port}  {r['state']}{extra}  {detail}".rstrip())
    for u in target["unplaced"]:
        print(f"  {u['count']} not placed: {u['reason']}")


def cmd_model_target(client: Client, args: argparse.Namespace) -> None:
    target = client.get(f"models/{args.name}/target")
    if args.json:
        _print_json(target)
    else:
        _print_target(target)


def cmd_model_plan(client: Client, args: argparse.Namespace) -> None:
    if args.file:
        path = Path(args.file)
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise CtlError(f"cannot read {path}: {exc.strerror}") from None
        plan = client.request("POST", "plan", data=text, content_type="application/yaml")
    elif args.name:
        plan = client.get(f"models/{args.name}/plan")
    else:
        raise CtlError("give a model's name, or -f FILE with a definition")
    if args.json:
        _print_json(plan)
        return
    print(f"{plan['model']}: {plan['desired']} replica(s) wanted (nothing is changed by this plan)")
    for p in plan["placements"]:
        print(f"  would run on {p['node']} (profile {p['profile']})")
    for u in plan["unplaced"]:
        print(f"  {u['count']} could not be placed: {u['reason']}")
    for p in plan["preemptions"]:
        print(f"  would stop a replica of {p['model']} on {p['node']}: {p['reason']}")
    if plan.get("estimate"):
        e = plan["estimate"]
        slots = f"{e['slots']} x " if e.get("slots") else ""
        prompt_cache = (
            f" + prompt cache {_size(e, 'prompt_cache')}"
            if e.get("prompt_cache_gb") is not None
            else ""
        )
        print(
            f"  memory estimate: {_size(e, 'total')} (weights {_size(e, 'weights')} + KV cache "
            f"{_size(e, 'kv_cache')} for {slots}{e['context_length']} tokens{prompt_cache})"
        )
    for warning in plan["warnings"]:
        print(f"  warning: {warning}")


def _size(estimate: dict[str, Any], part: str) -> str:
    """A part of a memory estimate in a unit that shows it (a small model is not "0.00 GB")."""
    size = estimate.get(f"{part}_bytes")
    return format_bytes(size if size is not None else estimate[f"{part}_gb"] * 1024**3)


def _bar(done: int, total: int, width: int = 30) -> str:
    fraction = done / total if total else 0.0
    filled = int(fraction * width)
    return f"[{'#' * filled}{' ' * (width - filled)}] {fraction * 100:5.1f}% {done / 1e6:.1f}/{total / 1e6:.1f} MB"


# How long a command waits without seeing anything move before it gives up and says
# what it was waiting for. Nothing on the server is stopped by giving up.
FETCH_WAIT = 120
ROLLOUT_WAIT = 900
MODEL_ADDED_WAIT = 30


class _Patience:
    """Gives up after `limit` seconds without progress; any change of the watched value resets it."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.last: Any = None
        self.since = time.monotonic()

    def exhausted(self, value: Any) -> bool:
        if value != self.last:
            self.last, self.since = value, time.monotonic()
            return False
        return time.monotonic() - self.since > self.limit


def _fetch_stalled(client: Client, fetch: dict[str, Any], limit: float) -> CtlError:
    where = f"It stays on the server: follow it at {client.url}/fetches/{fetch['id']}/"
    if fetch["state"] == "queued":
        return CtlError(
            f"gave up after {limit:g}s waiting for fetch {fetch['id']} of {fetch['repo']} to start: "
            "no worker has picked it up. Is the worker running (celery -A llmgw_site worker)? "
            + where
        )
    return CtlError(
        f"gave up after {limit:g}s without progress on fetch {fetch['id']} of {fetch['repo']} "
        f"({fetch['bytes_done'] / 1e6:.1f} of {fetch['bytes_total'] / 1e6:.1f} MB"
        + (f", {fetch['message']}" if fetch.get("message") else "")
        + "). "
        + where
    )


def _follow_fetch(
    client: Client, fetch: dict[str, Any], limit: float = FETCH_WAIT
) -> dict[str, Any]:
    """Show a fetch's progress on stderr until it ends, or until it stalls for `limit` seconds."""
    tty = sys.stderr.isatty()
    shown = -1
    patience = _Patience(limit)
    while fetch["state"] in ("queued", "running"):
        if patience.exhausted((fetch["state"], fetch["bytes_done"])):
            if tty:
                sys.stderr.write("\n")
            raise _fetch_stalled(client, fetch, limit)
        if tty:
            sys.stderr.write("\r" + _bar(fetch["bytes_done"], fetch["bytes_total"]))
            sys.stderr.flush()
        elif fetch["bytes_done"] != shown:
            shown = fetch["bytes_done"]
            print(_bar(fetch["bytes_done"], fetch["bytes_total"]), file=sys.stderr)
        time.sleep(0.5)
        fetch = client.get(f"fetches/{fetch['id']}")
    if tty:
        sys.stderr.write(
            "\r"
            + _bar(
                fetch["bytes_total"] if fetch["state"] == "done" else fetch["bytes_done"],
                fetch["bytes_total"],
            )
            + "\n"
        )
    return fetch


def cmd_model_serve(client: Client, args: argparse.Namespace) -> None:
    body = {
        "repo": args.repo,
        "file": args.file,
        "revision": args.revision,
        "name": args.name,
        "memory_gb": args.memory,
        "cores": args.cores,
        "min": args.min,
        "max": args.max,
    }
    fetch = client.post("serve", body)
    files = ", ".join(f["path"] for f in fetch["files"])
    print(
        f"Fetching {files} from {fetch['repo']} at {fetch['commit'][:7]} ({fetch['branch']}) into the mirror"
    )
    fetch = _follow_fetch(client, fetch, args.timeout)
    if fetch["state"] == "failed":
        raise CtlError(f"the fetch failed: {fetch['message']}")
    # The worker adds the model right after the last byte.
    deadline = time.monotonic() + MODEL_ADDED_WAIT
    while not fetch["model_added"] and fetch["state"] != "failed":
        if time.monotonic() > deadline:
            raise CtlError(
                f"the files of fetch {fetch['id']} are in the mirror, but the model was not added "
                f"within {MODEL_ADDED_WAIT}s; see {client.url}/fetches/{fetch['id']}/ and "
                "llmgw ctl models"
            )
        time.sleep(0.25)
        fetch = client.get(f"fetches/{fetch['id']}")
    if fetch["state"] == "failed":
        raise CtlError(fetch["message"])
    view = client.get(f"models/{fetch['model']}")
    print(
        f"{view['name']} added, owned by {view['owner']}; replicas {_scaling_text(view)}; "
        f"it follows {fetch['repo']} ({fetch['branch']}) at {fetch['commit'][:7]}."
    )
    print("It is placed on the reconciler's next pass; watch it with: llmgw ctl models")


def cmd_model_updates(client: Client, args: argparse.Namespace) -> None:
    result = client.post("updates/check", None) if args.check else client.get("updates")
    updates = result["updates"]
    if args.json:
        _print_json(updates)
        return
    if args.check:
        print(
            f"Asked the registry about {result['repositories']} repositories "
            f"({result['registry_requests']} requests)."
        )
    if not updates:
        print("Every served model is on the newest files its registry branch has.")
        return
    rows = []
    for u in updates:
        if u["error"]:
            rows.append(
                [
                    u["model"],
                    (u["current_commit"] or "")[:7],
                    "-",
                    u["error"],
                    (u["checked_at"] or "")[:19],
                ]
            )
            continue
        files = ", ".join(f"{f['path']} ({f['size'] / 1e6:.1f} MB)" for f in u["files"])
        rows.append(
            [
                u["model"],
                u["current_commit"][:7],
                u["new_commit"][:7],
                files,
                (u["checked_at"] or "")[:19],
            ]
        )
    print(_table(rows, ["MODEL", "CURRENT", "NEW", "FILES CHANGED", "CHECKED (UTC)"]))


def _follow_rollout(
    client: Client, name: str, rollout: dict[str, Any], limit: float = ROLLOUT_WAIT
) -> dict[str, Any]:
    last = ""
    patience = _Patience(limit)
    while rollout["state"] in ("fetching", "rolling"):
        line = f"{rollout['state']}: {rollout['step']}"
        if line != last:
            print(f"  {line}")
            last = line
        if patience.exhausted(line):
            raise CtlError(
                f"gave up after {limit:g}s with the {rollout['kind']} of {name} still at "
                f"'{line}'; it goes on on the server: llmgw ctl model target {name}"
            )
        time.sleep(0.5)
        rollout = client.get(f"models/{name}/rollout")
    print(f"  {rollout['state']}: {rollout['message']}")
    return rollout


def _rollout(client: Client, args: argparse.Namespace, kind: str) -> None:
    rollout = client.post(f"models/{args.name}/{kind}", None)
    print(
        f"{kind.capitalize()} of {args.name}: {rollout['from_commit'][:7] or '?'} -> {rollout['to_commit'][:7] or '?'}; "
        "replicas are replaced one at a time, a ready one always serving."
    )
    if not args.wait:
        print(
            f"Follow it with: llmgw ctl model {kind} {args.name} --wait (or llmgw ctl model target {args.name})"
        )
        return
    rollout = _follow_rollout(client, args.name, rollout, args.timeout)
    if rollout["state"] != "done":
        raise CtlError(f"the {kind} of {args.name} ended {rollout['state']}: {rollout['message']}")


def cmd_model_update(client: Client, args: argparse.Namespace) -> None:
    if args.wait:
        current = _current_rollout(client, args.name, "update")
        if current is not None:
            rollout = _follow_rollout(client, args.name, current, args.timeout)
            if rollout["state"] != "done":
                raise CtlError(
                    f"the update of {args.name} ended {rollout['state']}: {rollout['message']}"
                )
            return
    _rollout(client, args, "update")


def cmd_model_rollback(client: Client, args: argparse.Namespace) -> None:
    _rollout(client, args, "rollback")


def _current_rollout(client: Client, name: str, kind: str) -> dict[str, Any] | None:
    """An update already under way, which --wait follows instead of starting another."""
    try:
        rollout = client.get(f"models/{name}/rollout")
    except CtlError:
        return None
    return (
        rollout if rollout["kind"] == kind and rollout["state"] in ("fetching", "rolling") else None
    )


# -- the parser -----------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    ctl = subparsers.add_parser(
        "ctl",
        help="manage the catalog through the control plane's API",
        description="Talks to the control plane at LLMGW_URL with the API token in LLMGW_TOKEN.",
    )
    ctl.add_argument(
        "--url", help="the control plane (default: LLMGW_URL, else http://127.0.0.1:8000)"
    )
    ctl.add_argument("--token", help="an API token (default: LLMGW_TOKEN)")
    sub = ctl.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the models with their owner, class and replicas")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_models)

    p = sub.add_parser(
        "scale",
        help="set how many replicas a runtime model runs",
        description=SCALING_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name")
    p.add_argument(
        "--min", type=int, required=True, help="replicas to keep running: this is the count"
    )
    p.add_argument("--max", type=int, help="a ceiling; left out, it follows --min")
    p.add_argument(
        "--idle-timeout",
        help="how long an on-demand model stays up unasked-for, like 15m; 0 takes the cluster default",
    )
    p.set_defaults(run=cmd_scale)

    p = sub.add_parser("audit", help="who changed what, newest first")
    p.add_argument("--model")
    p.add_argument("--actor")
    p.add_argument("--action")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_audit)

    p = sub.add_parser(
        "nodes", help="the nodes: capacity, reserved, free, replicas, last heartbeat"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_nodes)

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

    p = sub.add_parser(
        "restart",
        help="replace every replica of a model, one at a time",
        description="A rolling restart: a new replica is started and must be ready before an old one is "
        "withdrawn from routing and stopped, so the model keeps serving. Where there is no room for "
        "an extra replica, they are replaced in place one at a time, keeping at least min - 1 serving. "
        "Replicas also pick up changed resources and adapters this way.",
    )
    p.add_argument("--model", required=True)
    p.set_defaults(run=cmd_restart)

    ctl_gateway.add_commands(sub)

    model = sub.add_parser("model", help="add, remove and change models while the cluster runs")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")

    p = msub.add_parser(
        "add",
        help="add a model from a YAML definition",
        description="The definition is the same YAML a model takes in server.yaml, so an entry moves "
        "between the two by copying. The whole catalog is validated before anything is written: a "
        "name already taken (by a model or an adapter), a fallback that does not exist, or a field "
        "nobody knows is refused, not stored. Before that, the control plane asks the source URL "
        "whether the weights are there. Once added, the model is placed on the reconciler's next "
        "pass, with no restart.",
    )
    p.add_argument("-f", "--file", required=True, help="the model definition, as YAML")
    p.add_argument(
        "--no-source-check",
        action="store_true",
        help="add it without asking whether the weights are at the source URL; right when the "
        "mirror is not up yet or the nodes reach it by an address the control plane does not",
    )
    p.set_defaults(run=cmd_model_add)

    p = msub.add_parser("target", help="what the reconciler aims for with a model, and why")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_model_target)

    p = msub.add_parser(
        "plan",
        help="where a model's replicas would go and what would be preempted, without changing anything",
        description="With -f, the definition as `model add -f` takes it (a new model or a change); with a "
        "NAME, the model as it is, placed afresh. The memory a replica needs is estimated from the "
        "GGUF header (weights plus the KV cache for the context length) and compared with each profile.",
    )
    p.add_argument("name", nargs="?")
    p.add_argument("-f", "--file", help="a model definition, as YAML")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_model_plan)

    p = msub.add_parser(
        "serve",
        help="fetch a registry repository's GGUF file into the mirror and add it as a model",
        description="Fetches one GGUF file of REPO (at the head of --revision) into the mirror, showing "
        "progress, then adds the model with the mirror URL as its source and the repository, branch, "
        "commit and file checksums as its origin, so that `model updates` can tell when the registry "
        "has newer files. Without --memory, a replica reserves the file's size plus a quarter, rounded up.",
    )
    p.add_argument("repo", help="ORG/NAME in the registry")
    p.add_argument(
        "--file", default="*.gguf", help="a glob picking the one GGUF file (default *.gguf)"
    )
    p.add_argument("--revision", default="main", help="the branch to follow (default main)")
    p.add_argument("--name", help="the model's name (default: from the file name)")
    p.add_argument("--memory", type=float, help="host RAM one replica reserves, in GB")
    p.add_argument("--cores", type=float, help="CPU cores one replica reserves (default 1)")
    p.add_argument("--min", type=int, default=1, help="the replica count (default 1)")
    p.add_argument("--max", type=int, help="a ceiling; left out, it follows --min")
    p.add_argument(
        "--timeout",
        type=float,
        default=FETCH_WAIT,
        metavar="SECONDS",
        help=f"give up waiting when the fetch has not started or moved for this long "
        f"(default {FETCH_WAIT}); the fetch itself goes on",
    )
    p.set_defaults(run=cmd_model_serve)

    p = msub.add_parser("updates", help="served models whose registry files changed")
    p.add_argument(
        "--check",
        action="store_true",
        help="ask the registry now, instead of showing the last check",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_model_updates)

    p = msub.add_parser(
        "update",
        help="move a model to the registry's newer files, one replica at a time",
        description="Fetches the new files beside the old ones in the mirror and checks their sha256; "
        "a mismatch refuses the update and changes nothing. Then the model's source moves to them and "
        "the replicas are replaced one at a time, each new one ready before an old one leaves. A new "
        "replica that keeps failing halts it; the old ones keep serving, and `model rollback` goes back.",
    )
    p.add_argument("name")
    p.add_argument("--wait", action="store_true", help="follow it to the end")
    p.add_argument(
        "--timeout",
        type=float,
        default=ROLLOUT_WAIT,
        metavar="SECONDS",
        help=f"with --wait, give up when no step has moved for this long (default {ROLLOUT_WAIT}); "
        "the rollout itself goes on",
    )
    p.set_defaults(run=cmd_model_update)

    p = msub.add_parser(
        "rollback",
        help="move a model back to its previous files (kept in the mirror)",
        description="The same way as an update: one replica at a time. An update still under way is stopped.",
    )
    p.add_argument("name")
    p.add_argument("--wait", action="store_true", help="follow it to the end")
    p.add_argument(
        "--timeout",
        type=float,
        default=ROLLOUT_WAIT,
        metavar="SECONDS",
        help=f"with --wait, give up when no step has moved for this long (default {ROLLOUT_WAIT}); "
        "the rollout itself goes on",
    )
    p.set_defaults(run=cmd_model_rollback)

    p = msub.add_parser("show", help="a model's definition, as YAML you can copy into server.yaml")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_model_show)

    p = msub.add_parser(
        "remove",
        help="remove a model added at runtime",
        description="Only models added at runtime: one declared in server.yaml would come back on "
        "the next start. Its replicas are withdrawn from routing before they are stopped.",
    )
    p.add_argument("name")
    p.set_defaults(run=cmd_model_remove)

    p = msub.add_parser(
        "resources",
        help="set what a replica reserves of a node",
        description=RESOURCES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name")
    p.add_argument(
        "--memory", type=float, required=True, help="host RAM one replica reserves, in GB"
    )
    p.add_argument("--cores", type=float, help="CPU cores one replica reserves; 0 reserves none")
    p.add_argument("--profile", help="change one profile; every profile when left out")
    p.set_defaults(run=cmd_model_resources)

    p = msub.add_parser(
        "class",
        help="set how a model's capacity weighs against others'",
        description=CLASS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name")
    p.add_argument(
        "klass", metavar="CLASS", choices=["critical", "standard", "opportunistic", "default"]
    )
    p.set_defaults(run=cmd_model_class)

    p = msub.add_parser("owner", help="hand a model over to another user (its owner or staff)")
    p.add_argument("name")
    p.add_argument("user")
    p.set_defaults(run=cmd_model_owner)

    p = msub.add_parser(
        "adapters",
        help="list, add or remove a model's LoRA adapters",
        description=ADAPTERS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name")
    p.add_argument(
        "--add", action="append", default=[], metavar="NAME=URL[@SCALE]", help="repeatable"
    )
    p.add_argument("--remove", action="append", default=[], metavar="NAME", help="repeatable")
    p.add_argument(
        "--no-source-check",
        action="store_true",
        help="store the adapters without checking the files",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_model_adapters)


def run(args: argparse.Namespace) -> int:
    client = Client(url=args.url, token=args.token)
    try:
        args.run(client, args)
    except CtlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0

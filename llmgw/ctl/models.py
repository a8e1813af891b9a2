"""`llmgw ctl models`, `scale`, `restart` and `model …`: the catalog's models and their settings.

The registry's commands under `model` (serve, updates, update, rollback) are in `updates`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from llmgw.client import Client, CtlError
from llmgw.units import format_bytes

from .commands import command
from .output import print_json, program, scaling_text, table, table_wanted

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


def add_models(sub: Any) -> None:
    p = command(
        sub, "models", "list the models with their owner, class and replicas", run=cmd_models
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_models(client: Client, args: argparse.Namespace) -> None:
    models = client.get("models")
    if not table_wanted(
        args, models, f"No models yet. Add one with: {program()} ctl model add -f model.yaml"
    ):
        return
    rows = [
        [
            m["name"],
            f"{m['ready']}/{m['desired']}",
            m["kind"],
            m["owner"] or "-",
            m["class"],
            scaling_text(m),
            "replacement halted" if m.get("rollout_halted") else "",
        ]
        for m in models
    ]
    print(table(rows, ["NAME", "READY", "KIND", "OWNER", "CLASS", "SCALING", "NOTE"]))


def add_scale(sub: Any) -> None:
    p = command(
        sub, "scale", "set how many replicas a runtime model runs", SCALING_HELP, run=cmd_scale
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
    print(f"Watch it with: {program()} ctl models")


def add_restart(sub: Any) -> None:
    p = command(
        sub,
        "restart",
        "replace every replica of a model, one at a time",
        "A rolling restart: a new replica is started and must be ready before an old one is "
        "withdrawn from routing and stopped, so the model keeps serving. Where there is no room for "
        "an extra replica, they are replaced in place one at a time, keeping at least min - 1 serving. "
        "Replicas also pick up changed resources and adapters this way.",
        run=cmd_restart,
    )
    p.add_argument("--model", required=True)


def cmd_restart(client: Client, args: argparse.Namespace) -> None:
    result = client.post(f"models/{args.model}/restart", None)
    print(
        f"{result['model']} restarts, one replica at a time: each new replica must be ready before an "
        f"old one is withdrawn (generation {result['generation']}). Watch it with: {program()} ctl model target {result['model']}"
    )


def add_model_add(msub: Any) -> None:
    p = command(
        msub,
        "add",
        "add a model from a YAML definition",
        "The definition is the same YAML a model takes in server.yaml, so an entry moves "
        "between the two by copying. The whole catalog is validated before anything is written: a "
        "name already taken (by a model or an adapter), a fallback that does not exist, or a field "
        "nobody knows is refused, not stored. Before that, the control plane asks the source URL "
        "whether the weights are there. Once added, the model is placed on the reconciler's next "
        "pass, with no restart.",
        run=cmd_model_add,
    )
    p.add_argument("-f", "--file", required=True, help="the model definition, as YAML")
    p.add_argument(
        "--no-source-check",
        action="store_true",
        help="add it without asking whether the weights are at the source URL; right when the "
        "mirror is not up yet or the nodes reach it by an address the control plane does not",
    )


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
        f"{view['name']} added, owned by {view['owner']}; class {view['class']}; replicas {scaling_text(view)}."
    )
    print(f"It is placed on the reconciler's next pass; watch it with: {program()} ctl models")


def add_model_target(msub: Any) -> None:
    p = command(
        msub, "target", "what the reconciler aims for with a model, and why", run=cmd_model_target
    )
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_model_target(client: Client, args: argparse.Namespace) -> None:
    target = client.get(f"models/{args.name}/target")
    if args.json:
        print_json(target)
    else:
        _print_target(target)


def _print_target(target: dict[str, Any]) -> None:
    print(
        f"{target['model']}: {target['ready']} ready of {target['desired']} wanted ({target['why']}); class {target['class']}"
    )
    if target.get("rollout_halted"):
        print(f"  replacement {target['rollout_halted']}")
    for r in target["replicas"]:
        extra = "" if r["up_to_date"] else " (out of date)"
        detail = r["withdraw_reason"] if r["state"] == "withdrawn" else r["message"]
        if r.get("move_reason") and r["state"] != "withdrawn":
            detail = f"{detail}  {r['move_reason']}".strip()
        port = f":{r['port']}" if r["port"] else ""
        gpus = f" GPU {', '.join(str(i) for i in r['devices'])}" if r.get("devices") else ""
        print(f"  {r['node']}{port}{gpus}  {r['state']}{extra}  {detail}".rstrip())
    for u in target["unplaced"]:
        print(f"  {u['count']} not placed: {u['reason']}")


def add_model_plan(msub: Any) -> None:
    p = command(
        msub,
        "plan",
        "where a model's replicas would go and what would be preempted, without changing anything",
        "With -f, the definition as `model add -f` takes it (a new model or a change); with a "
        "NAME, the model as it is, placed afresh. The memory a replica needs is estimated from the "
        "GGUF header (weights plus the KV cache for the context length) and compared with each profile.",
        run=cmd_model_plan,
    )
    p.add_argument("name", nargs="?")
    p.add_argument("-f", "--file", help="a model definition, as YAML")
    p.add_argument("--json", action="store_true", help="print JSON")


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
        print_json(plan)
        return
    print(f"{plan['model']}: {plan['desired']} replica(s) wanted (nothing is changed by this plan)")
    for p in plan["placements"]:
        devices = p.get("devices") or []
        on = (
            f" GPU{'' if len(devices) == 1 else 's'} {', '.join(str(i) for i in devices)} "
            f"({p['gpu_memory_gb_per_device']:g} GB{' each' if len(devices) > 1 else ''})"
            if devices
            else ""
        )
        print(f"  would run on {p['node']}{on} (profile {p['profile']})")
    for u in plan["unplaced"]:
        print(f"  {u['count']} could not be placed: {u['reason']}")
        for d in u.get("devices") or []:
            print(
                f"    {d['node']} GPU {d['index']}: {d['total_gb']:g} GB, {d['reserved_gb']:g} GB "
                f"reserved by llmgw, {d['used_by_others_gb']:g} GB used by other programs, "
                f"{d['free_gb']:g} GB free; needs {d['needed_gb']:g} GB"
            )
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
        if e.get("gpus"):
            layers = "every layer" if e["gpu_layers"] == "all" else f"{e['gpu_layers']} layers"
            print(
                f"  on its {e['gpus']} GPU{'' if e['gpus'] == 1 else 's'}: "
                f"{format_bytes(e['gpu_bytes'])} ({layers}, {e['offloaded']:.0%} of the model), "
                f"{e['gpu_reserved_gb_per_gpu']:g} GB reserved on each; in host memory: "
                f"{format_bytes(e['host_bytes'])}"
            )
    for warning in plan["warnings"]:
        print(f"  warning: {warning}")


def _size(estimate: dict[str, Any], part: str) -> str:
    """A part of a memory estimate in a unit that shows it (a small model is not "0.00 GB")."""
    size = estimate.get(f"{part}_bytes")
    return format_bytes(size if size is not None else estimate[f"{part}_gb"] * 1024**3)


def add_model_show(msub: Any) -> None:
    p = command(
        msub,
        "show",
        "a model's definition, as YAML you can copy into server.yaml, and where the weights "
        "of a model that follows the registry come from",
        run=cmd_model_show,
    )
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_model_show(client: Client, args: argparse.Namespace) -> None:
    view = client.get(f"models/{args.name}")
    if args.json:
        print_json(view)
        return

    print(
        f"# {view['name']}: {view['kind']}, owner {view['owner'] or '-'}, class {view['class']}, "
        f"replicas {scaling_text(view)}"
    )
    print(yaml.safe_dump(view["definition"], sort_keys=False).rstrip())
    for line in _origin_lines(view["origin"]):
        print(line)


def _origin_lines(origin: dict[str, Any] | None) -> list[str]:
    """Where the weights of a model that follows the registry come from, as YAML comments: the
    definition above them stays one that `model add -f` takes back. None for any other model."""
    if not origin:
        return []
    lines = [
        "# Its weights follow the registry:",
        f"#   repository {origin.get('repo') or '?'}",
        f"#   branch     {origin.get('branch') or 'main'}",
        f"#   commit     {origin.get('commit') or '?'}",
    ]
    lines += [f"#   file       {f['path']}" for f in origin.get("files") or () if f.get("path")]
    return lines


def add_model_remove(msub: Any) -> None:
    p = command(
        msub,
        "remove",
        "remove a model added at runtime",
        "Only models added at runtime: one declared in server.yaml would come back on "
        "the next start. Its replicas are withdrawn from routing before they are stopped.",
        run=cmd_model_remove,
    )
    p.add_argument("name")


def cmd_model_remove(client: Client, args: argparse.Namespace) -> None:
    client.delete(f"models/{args.name}")
    print(
        f"{args.name} removed. Its replicas are withdrawn from routing, then stopped, on the next pass."
    )


def add_model_resources(msub: Any) -> None:
    p = command(
        msub,
        "resources",
        "set what a replica reserves of a node",
        RESOURCES_HELP,
        run=cmd_model_resources,
    )
    p.add_argument("name")
    p.add_argument(
        "--memory", type=float, required=True, help="host RAM one replica reserves, in GB"
    )
    p.add_argument("--cores", type=float, help="CPU cores one replica reserves; 0 reserves none")
    p.add_argument("--profile", help="change one profile; every profile when left out")


def cmd_model_resources(client: Client, args: argparse.Namespace) -> None:
    body = {"memory_gb": args.memory, "cores": args.cores, "profile": args.profile}
    view = client.post(f"models/{args.name}/resources", body)
    for p in view["definition"]["profiles"]:
        print(
            f"{view['name']}/{p['name']}: {p['memory_gb']:g} GB memory, {p['cores']:g} cores, {p['gpus']} GPUs"
        )
    print(
        f"Running replicas keep their old figures until restarted: {program()} ctl restart --model {view['name']}"
    )


def add_model_class(msub: Any) -> None:
    p = command(
        msub,
        "class",
        "set how a model's capacity weighs against others'",
        CLASS_HELP,
        run=cmd_model_class,
    )
    p.add_argument("name")
    p.add_argument(
        "klass", metavar="CLASS", choices=["critical", "standard", "opportunistic", "default"]
    )


def cmd_model_class(client: Client, args: argparse.Namespace) -> None:
    view = client.post(f"models/{args.name}/class", {"class": args.klass})
    how = "set explicitly" if view["class_set"] != "default" else "the default for its scaling"
    print(f"{view['name']} is {view['class']} ({how}). It applies from the next pass.")


AUTOSCALE_HELP = (
    "Off by default: a model runs its --min replicas, and --max is only a ceiling. With a policy "
    "on, the reconciler may run between the model's floor (its --min, or 1 while an on-demand "
    "model is awake) and its --max: one replica more when the gateways' queue wait (p50) for it "
    "stays over --wait for --up-after, one fewer when a replica's worth of its slots stays "
    "unused for --down-after. One step per window at most; `model target` says why the count "
    "is what it is."
)


def add_model_autoscale(msub: Any) -> None:
    p = command(
        msub,
        "autoscale",
        "let a model's replica count follow its queue wait, between its --min and --max",
        AUTOSCALE_HELP,
        run=cmd_model_autoscale,
    )
    p.add_argument("name")
    p.add_argument("--wait", help="the queue wait (p50) to hold the model under, like 2s")
    p.add_argument("--up-after", help="how long the wait stays over it before adding (30s)")
    p.add_argument("--down-after", help="how long a replica stays unused before removing (10m)")
    p.add_argument("--off", action="store_true", help="turn the policy off")
    p.add_argument("--json", action="store_true", help="print the model as JSON")


def cmd_model_autoscale(client: Client, args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"off": True} if args.off else {}
    for field in ("wait", "up_after", "down_after"):
        value = getattr(args, field)
        if value is not None:
            body[field] = value
    if not args.off and "wait" not in body:
        raise CtlError("give --wait (like 2s) to turn the policy on, or --off to turn it off")
    view = client.post(f"models/{args.name}/autoscale", body)
    if args.json:
        print_json(view)
        return
    policy = view.get("autoscale")
    if policy is None:
        print(f"{view['name']}: autoscaling off; it runs {scaling_text(view)}.")
        return
    s = view["scaling"]
    print(
        f"{view['name']}: autoscaling between {max(s['min'], 1)} and {s['max']} replicas, to "
        f"keep its queue wait under {policy['wait']} (up after {policy['up_after']}, down "
        f"after {policy['down_after']}). It applies from the next pass."
    )
    print(f"Watch why with: {program()} ctl model target {view['name']}")


def add_model_owner(msub: Any) -> None:
    p = command(
        msub, "owner", "hand a model over to another user (its owner or staff)", run=cmd_model_owner
    )
    p.add_argument("name")
    p.add_argument("user")


def cmd_model_owner(client: Client, args: argparse.Namespace) -> None:
    view = client.post(f"models/{args.name}/owner", {"owner": args.user})
    print(f"{view['name']} is now owned by {view['owner']}.")


def add_model_adapters(msub: Any) -> None:
    p = command(
        msub,
        "adapters",
        "list, add or remove a model's LoRA adapters",
        ADAPTERS_HELP,
        run=cmd_model_adapters,
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


def cmd_model_adapters(client: Client, args: argparse.Namespace) -> None:
    if not args.add and not args.remove:
        adapters = client.get(f"models/{args.name}/adapters")
    else:
        body = {"add": [_parse_adapter(s) for s in args.add], "remove": args.remove}
        params = {"source_check": "false"} if args.no_source_check else {}
        adapters = client.post(f"models/{args.name}/adapters", body, **params)
    if args.json:
        print_json(adapters)
        return
    if not adapters:
        print(f"{args.name} has no adapters.")
    for a in adapters:
        print(f"{a['name']}\tscale {a['scale']:g}\t{a['source']}")
    if args.add or args.remove:
        print(
            f"{args.name} serves {len(adapters)} adapter(s); replicas load them when restarted: "
            f"{program()} ctl restart --model {args.name}"
        )


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

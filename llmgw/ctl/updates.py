"""`llmgw ctl model serve`, `updates`, `update` and `rollback`: models that follow the registry.

Serving fetches a repository's file into the mirror and adds the model; an update or a
rollback replaces the replicas one at a time. The commands that wait show progress and
give up, saying what they waited for, when nothing has moved for a while.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from llmgw.client import Client, CtlError
from llmgw.units import format_progress, format_size

from .canary import add_canary_flags, canary_body, describe
from .commands import command
from .output import print_json, program, scaling_text, table

# How long a command waits without seeing anything move before it gives up and says
# what it was waiting for. Nothing on the server is stopped by giving up.
FETCH_WAIT = 120
ROLLOUT_WAIT = 900
MODEL_ADDED_WAIT = 30


def add_model_serve(msub: Any) -> None:
    p = command(
        msub,
        "serve",
        "fetch a registry repository's GGUF file into the mirror and add it as a model",
        "Fetches one GGUF file of REPO (at the head of --revision) into the mirror, showing "
        "progress, then adds the model with the mirror URL as its source and the repository, branch, "
        "commit and file checksums as its origin, so that `model updates` can tell when the registry "
        "has newer files. Without --memory, a replica reserves the file's size (with --mmproj's) plus a "
        "quarter, rounded up.",
        run=cmd_model_serve,
    )
    p.add_argument("repo", help="ORG/NAME in the registry")
    p.add_argument(
        "--file",
        help="a glob picking the one GGUF file (default *.gguf); with --engine vllm, globs "
        "separated by commas picking the snapshot's files (default: its config, tokenizer and "
        "safetensors files)",
    )
    p.add_argument(
        "--engine",
        help="the engine the model runs: llama.cpp (the default) or vllm, which loads the "
        "repository's Hugging Face snapshot",
    )
    p.add_argument("--revision", default="main", help="the branch to follow (default main)")
    p.add_argument("--name", help="the model's name (default: from the file name)")
    p.add_argument(
        "--mmproj",
        metavar="PATH",
        help="a vision projector of REPO (its path there, like mmproj-model-f16.gguf) to fetch "
        "with the weights and serve beside them, so that the model takes images; it follows "
        "every update and rollback of the weights",
    )
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


def cmd_model_serve(client: Client, args: argparse.Namespace) -> None:
    body = {
        "repo": args.repo,
        "file": args.file,
        "revision": args.revision,
        "name": args.name,
        **({"mmproj": args.mmproj} if args.mmproj else {}),
        **({"engine": args.engine} if args.engine else {}),
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
                f"{program()} ctl models"
            )
        time.sleep(0.25)
        fetch = client.get(f"fetches/{fetch['id']}")
    if fetch["state"] == "failed":
        raise CtlError(fetch["message"])
    view = client.get(f"models/{fetch['model']}")
    print(
        f"{view['name']} added, owned by {view['owner']}; replicas {scaling_text(view)}; "
        f"it follows {fetch['repo']} ({fetch['branch']}) at {fetch['commit'][:7]}."
    )
    print(f"It is placed on the reconciler's next pass; watch it with: {program()} ctl models")


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
        f"({format_progress(fetch['bytes_done'], fetch['bytes_total'])}"
        + (f", {fetch['message']}" if fetch.get("message") else "")
        + "). "
        + where
    )


def _bar(done: int, total: int, width: int = 30) -> str:
    fraction = done / total if total else 0.0
    filled = int(fraction * width)
    return f"[{'#' * filled}{' ' * (width - filled)}] {fraction * 100:5.1f}% {format_progress(done, total)}"


def add_model_updates(msub: Any) -> None:
    p = command(
        msub, "updates", "served models whose registry files changed", run=cmd_model_updates
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="ask the registry now, instead of showing the last check",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the updates, and the canaries under way with their figures",
    )


def cmd_model_updates(client: Client, args: argparse.Namespace) -> None:
    result = client.post("updates/check", None) if args.check else client.get("updates")
    updates = result["updates"]
    under_way = [c for c in client.get("canaries")["canaries"] if c["active"]]
    if args.json:
        print_json({"updates": updates, "canaries": under_way})
        return
    if args.check:
        print(
            f"Asked the registry about {result['repositories']} repositories "
            f"({result['registry_requests']} requests)."
        )
    for canary in under_way:
        print(describe(canary))
        print()
    if not updates:
        if not under_way:
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
        files = ", ".join(f"{f['path']} ({format_size(f['size'])})" for f in u["files"])
        rows.append(
            [
                u["model"],
                u["current_commit"][:7],
                u["new_commit"][:7],
                files,
                (u["checked_at"] or "")[:19],
            ]
        )
    print(table(rows, ["MODEL", "CURRENT", "NEW", "FILES CHANGED", "CHECKED (UTC)"]))
    for u in updates:
        if u.get("rolled_back_from") and not u["error"]:
            print(
                f"{u['model']} was rolled back from {u['rolled_back_from'][:7]}; "
                f"`{program()} ctl model update {u['model']}` moves it to {u['new_commit'][:7]} "
                "again."
            )


def add_model_update(msub: Any) -> None:
    p = command(
        msub,
        "update",
        "move a model to the registry's newer files, one replica at a time",
        "Fetches the new files beside the old ones in the mirror and checks their sha256; "
        "a mismatch refuses the update and changes nothing. Then the model's source moves to them and "
        "the replicas are replaced one at a time, each new one ready before an old one leaves. A new "
        "replica that keeps failing halts it; the old ones keep serving, and `model rollback` goes back.",
        run=cmd_model_update,
    )
    p.add_argument("name")
    add_canary_flags(p)
    _add_rollout_wait(p)


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
    _rollout(client, args, "update", canary_body(args))


def _current_rollout(client: Client, name: str, kind: str) -> dict[str, Any] | None:
    """An update already under way, which --wait follows instead of starting another."""
    try:
        rollout = client.get(f"models/{name}/rollout")
    except CtlError:
        return None
    return (
        rollout if rollout["kind"] == kind and rollout["state"] in ("fetching", "rolling") else None
    )


def add_model_rollback(msub: Any) -> None:
    p = command(
        msub,
        "rollback",
        "move a model back to its previous files (kept in the mirror)",
        "The same way as an update: one replica at a time. An update still under way is stopped.",
        run=cmd_model_rollback,
    )
    p.add_argument("name")
    _add_rollout_wait(p)


def cmd_model_rollback(client: Client, args: argparse.Namespace) -> None:
    _rollout(client, args, "rollback")


def _add_rollout_wait(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", action="store_true", help="follow it to the end")
    p.add_argument(
        "--timeout",
        type=float,
        default=ROLLOUT_WAIT,
        metavar="SECONDS",
        help=f"with --wait, give up when no step has moved for this long (default {ROLLOUT_WAIT}); "
        "the rollout itself goes on",
    )


def _rollout(
    client: Client, args: argparse.Namespace, kind: str, body: dict[str, Any] | None = None
) -> None:
    rollout = client.post(f"models/{args.name}/{kind}", body)
    change = f"{kind.capitalize()} of {args.name}: {rollout['from_commit'][:7] or '?'} -> {rollout['to_commit'][:7] or '?'}"
    if body and body.get("canary"):
        print(
            f"{change}; first a canary: one replica on the new files gets {body['canary']}% of the "
            "requests, then the others are replaced one at a time when it is healthy, or it is "
            "rolled back by itself when not."
        )
    else:
        print(f"{change}; replicas are replaced one at a time, a ready one always serving.")
    if not args.wait:
        print(
            f"Follow it with: {program()} ctl model {kind} {args.name} --wait (or {program()} ctl "
            f"model target {args.name})"
        )
        return
    rollout = _follow_rollout(client, args.name, rollout, args.timeout)
    if rollout["state"] != "done":
        raise CtlError(f"the {kind} of {args.name} ended {rollout['state']}: {rollout['message']}")


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
                f"'{line}'; it goes on on the server: {program()} ctl model target {name}"
            )
        time.sleep(0.5)
        rollout = client.get(f"models/{name}/rollout")
    print(f"  {rollout['state']}: {rollout['message']}")
    return rollout


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

"""`llmgw ctl keys`, `key` and `usage`: the gateway keys applications send to /v1/, and what they used."""

from __future__ import annotations

import argparse
from datetime import date
from typing import Any

from llmgw.client import Client, CtlError

from .commands import command
from .limits import COUNTERS, add_limit_flags, counter_flag, limit_lines, limits_body
from .output import print_json, program, table, table_wanted

KEYS_HELP = """\
Applications send OpenAI-style requests to the gateway at LLMGW_URL/v1 with a
gateway key (OpenAI clients: base_url=LLMGW_URL/v1, api_key=KEY). A key is
yours: you see and revoke your own keys, staff see and revoke everyone's. The
key itself is printed once, when it is created; only its first characters are
kept, to tell keys apart."""


def add_keys(sub: Any) -> None:
    p = command(
        sub,
        "keys",
        "the gateway keys: yours, and your teams' where you are team admin (staff: everyone's)",
        KEYS_HELP,
        run=cmd_keys,
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_keys(client: Client, args: argparse.Namespace) -> None:
    keys = client.get("keys")
    if not table_wanted(
        args, keys, f"No gateway keys yet. Create one with: {program()} ctl key create NAME"
    ):
        return
    rows = [
        [
            str(k["id"]),
            k["prefix"] + "…",
            k["name"],
            k["owner"],
            k["state"],
            _when(k["created_at"]),
            _when(k["last_used_at"]),
        ]
        for k in keys
    ]
    print(table(rows, ["ID", "KEY", "NAME", "OWNER", "STATE", "CREATED (UTC)", "LAST USED (UTC)"]))


def add_key(sub: Any) -> None:
    key = command(sub, "key", "create and revoke gateway keys", KEYS_HELP)
    ksub = key.add_subparsers(dest="key_command", required=True, metavar="COMMAND")
    p = command(
        ksub,
        "create",
        "create a key of your own and print it (shown only this once)",
        "NAME says what the key is for (say, the application that will use it). "
        "The key works at once; keep it as you would a password.",
        run=cmd_key_create,
    )
    p.add_argument("name")
    add_limit_flags(p, key=True)
    p.add_argument("--json", action="store_true", help="print JSON (the key included)")
    p = command(
        ksub,
        "limits",
        "change a key's limits, models, weight, team or expiry",
        "Your own keys, or anyone's for staff; a flag not given leaves that setting "
        "as it is, and 0 or none lifts a limit. What staff set on a key, and its key policy's "
        "ceilings, are ceilings: its owner may lower a limit and never raise or lift it past "
        "one, nor take the key out of their teams with limits. A key's limits are at most its "
        "team's; only staff raise a key's weight. The gateway holds them within a second.",
        run=cmd_key_limits,
    )
    p.add_argument("id", type=_key_id, help="the key's ID, as `llmgw ctl keys` lists it")
    add_limit_flags(p, key=True)
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command(
        ksub,
        "revoke",
        "revoke a key: requests with it are refused from now on",
        "Your own keys, or anyone's for staff. A revoked key stays listed, "
        "with when it was last used; revoking it again changes nothing.",
        run=cmd_key_revoke,
    )
    p.add_argument("id", type=_key_id, help="the key's ID, as `llmgw ctl keys` lists it")
    add_key_policies(ksub)
    add_user_weights(ksub)


def cmd_key_create(client: Client, args: argparse.Namespace) -> None:
    key = client.post("keys", {"name": args.name, **limits_body(args)})
    if args.json:
        print_json(key)
        return
    print(
        f"Gateway key {key['id']} ({key['name']}) created for {key['owner']}. It is shown only now:"
    )
    print(f"\n  {key['key']}\n")
    if _has_settings(key):
        print(*_settings_lines(key), sep="\n")
    print("Use it with any OpenAI client:")
    print(f"  base_url={client.url}/v1  api_key={key['key']}")
    print(f"Revoke it with: {program()} ctl key revoke {key['id']}")


def cmd_key_limits(client: Client, args: argparse.Namespace) -> None:
    key = client.request("PATCH", f"keys/{args.id}/limits", json=limits_body(args))
    if args.json:
        print_json(key)
        return
    print(f"Gateway key {key['id']} ({key['prefix']}…, {key['name']}, owned by {key['owner']}):")
    print(*_settings_lines(key), sep="\n")
    print("The gateway holds these within a second.")


def _has_settings(key: dict[str, Any]) -> bool:
    limits = key["limits"]
    counted = any(limits[f] is not None for f in limits if f not in ("models", "weight"))
    return bool(counted or limits["models"] or limits["weight"] != 1 or key["team"])


def _settings_lines(key: dict[str, Any]) -> list[str]:
    """What is in force for a key: its team, expiry and limits (with today's use), and the
    ceilings its owner is held to, where there are any."""
    team = key["team"] or "none"
    expires = f"{_when(key['expires_at'])} UTC" if key["expires_at"] else "never"
    lines = [f"  {'team':<17} {team}", f"  {'expires':<17} {expires}", *limit_lines(key)]
    ceilings = ceilings_text(key.get("ceilings") or {})
    if ceilings:
        policy = f"; key policy {key['policy']}" if key.get("policy") else ""
        lines.append(f"  {'ceilings':<17} {ceilings} (the owner may lower, not raise{policy})")
    return lines


def ceilings_text(ceilings: dict[str, Any]) -> str:
    """A key's ceilings on one line; the weight's only where staff set one above 1 or below."""
    parts = [
        f"{field.replace('_', '-')} {ceilings[field]:,}"
        for field in COUNTERS
        if ceilings.get(field) is not None
    ]
    if ceilings.get("models"):
        parts.append("models " + ",".join(ceilings["models"]))
    if ceilings.get("expires_at"):
        parts.append(f"expires {_when(ceilings['expires_at'])} UTC")
    return ", ".join(parts)


# -- key policies ---------------------------------------------------------------------------

POLICY_HELP = """A key policy gives the keys under it a default for each limit (what a new key
gets when it is not given one) and a ceiling (the most the key's owner may set
it to; keys above a new ceiling are lowered to it). SCOPE is which keys:
  team:NAME   the keys in the team NAME
  user:NAME   NAME's keys in no team (or in a team without a policy)
  default     everyone else's keys in no team
Staff set them; a user sees those that may hold their keys. What staff set on a
key itself is its own ceiling, in place of its policy's."""


def add_key_policies(ksub: Any) -> None:
    p = command(
        ksub,
        "policies",
        "the key policies: each limit's default and ceiling for new and existing keys",
        POLICY_HELP,
        run=cmd_key_policies,
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command(
        ksub,
        "policy",
        "show a key policy, or set its defaults and ceilings (staff)",
        POLICY_HELP + "\n\nWith no flags it shows the policy; a flag not given leaves that "
        "figure as it is, and 0 or none takes it away.",
        run=cmd_key_policy,
    )
    p.add_argument("scope", help="team:NAME, user:NAME or default")
    for field, (meaning, _) in COUNTERS.items():
        flag = field.replace("_", "-")
        p.add_argument(
            f"--default-{flag}",
            dest=f"default_{field}",
            type=counter_flag,
            metavar="N",
            help=f"what a new key gets of {meaning} when not given",
        )
        p.add_argument(
            f"--max-{flag}",
            dest=f"max_{field}",
            type=counter_flag,
            metavar="N",
            help=f"the most an owner may set a key's {meaning} to",
        )
    p.add_argument(
        "--remove",
        action="store_true",
        help="remove the policy: its keys keep their limits (staff)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


WEIGHT_HELP = """When every slot of a model is busy, requests wait in the gateway and take turns: between
teams and people in no team, then between a team's people, then between a person's keys. A
person's weight is their share beside the others (in a team: of the team's share); with none set
it is 1 in a team, and their heaviest key's weight outside one."""


def add_user_weights(ksub: Any) -> None:
    p = command(
        ksub,
        "weights",
        "the people staff gave a weight in the fair queue",
        WEIGHT_HELP,
        run=cmd_user_weights,
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command(
        ksub,
        "weight",
        "set a person's weight in the fair queue, or clear it (staff)",
        WEIGHT_HELP,
        run=cmd_user_weight,
    )
    p.add_argument("user", help="the person's username")
    p.add_argument("weight", nargs="?", type=float, help="above 0, at most 1000")
    p.add_argument("--clear", action="store_true", help="set none (the default)")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_user_weights(client: Client, args: argparse.Namespace) -> None:
    found = client.get("keys/weights")
    none = (
        f"Nobody has a weight of their own. Staff set one with: {program()} ctl key weight USER N"
    )
    if args.json:
        print_json(found)
    elif table_wanted(args, found["people"], none):
        rows = [[p["user"], f"{p['weight']:g}"] for p in found["people"]]
        print(table(rows, ["USER", "WEIGHT"]))


def cmd_user_weight(client: Client, args: argparse.Namespace) -> None:
    if args.clear == (args.weight is not None):
        raise CtlError(
            f"give a weight (say, {program()} ctl key weight alice 2) or --clear, not both"
        )
    answer = client.request("PUT", f"keys/weights/{args.user}", json={"weight": args.weight})
    if args.json:
        print_json(answer)
    elif answer["weight"] is None:
        print(f"{answer['user']} has no weight of their own now (1 in a team; their heaviest "
              "key's outside one).")  # fmt: skip
    else:
        print(f"{answer['user']} now weighs {answer['weight']:g} in the fair queue.")


def cmd_key_policies(client: Client, args: argparse.Namespace) -> None:
    found = client.get("keys/policies")
    none = (
        f"No key policies. Staff set one with: {program()} ctl key policy default --max-rpm N ..."
    )
    if not table_wanted(args, found, none):
        return
    rows = [
        [p["scope"], _figures_text(p["defaults"]) or "none", _figures_text(p["ceilings"]) or "none"]
        for p in found
    ]
    print(table(rows, ["SCOPE", "DEFAULTS", "CEILINGS"]))


def cmd_key_policy(client: Client, args: argparse.Namespace) -> None:
    if args.remove:
        gone = client.delete(f"keys/policies/{args.scope}")
        print(f"Key policy {gone['scope']} removed; its keys keep their limits.")
        return
    body: dict[str, dict[str, int]] = {}
    for part, prefix in (("defaults", "default"), ("ceilings", "max")):
        figures = {f: getattr(args, f"{prefix}_{f}") for f in COUNTERS}
        given = {f: figure for f, figure in figures.items() if figure is not None}
        if given:
            body[part] = given
    if not body:
        policy = client.get(f"keys/policies/{args.scope}")
        _print_policy(policy, args, f"Key policy {policy['scope']}:")
        return
    policy = client.request("PATCH", f"keys/policies/{args.scope}", json=body)
    lowered = policy["lowered"]
    then = (
        f"{lowered} key(s) under it were above a ceiling and are lowered to it. " if lowered else ""
    ) + "New keys get its defaults; the gateway holds the lowered limits within a second."
    _print_policy(policy, args, f"Key policy {policy['scope']} now:", then)


def _print_policy(
    policy: dict[str, Any], args: argparse.Namespace, title: str, then: str = ""
) -> None:
    if args.json:
        print_json(policy)
        return
    print(title)
    for field, (_, unit) in COUNTERS.items():
        default, ceiling = policy["defaults"][field], policy["ceilings"][field]
        shown = "no default" if default is None else f"default {default:,}"
        shown += ", no ceiling" if ceiling is None else f", ceiling {ceiling:,}"
        print(f"  {field.replace('_', '-'):<17} {shown} ({unit})")
    if then:
        print(then)


def _figures_text(figures: dict[str, Any]) -> str:
    return ", ".join(
        f"{field.replace('_', '-')} {figures[field]:,}"
        for field in COUNTERS
        if figures.get(field) is not None
    )


def cmd_key_revoke(client: Client, args: argparse.Namespace) -> None:
    key = client.post(f"keys/{args.id}/revoke", None)
    print(
        f"Gateway key {key['id']} ({key['prefix']}…, {key['name']}, owned by {key['owner']}) is revoked "
        f"since {_when(key['revoked_at'])} UTC: requests with it get 401."
    )


def _key_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a key id; `{program()} ctl keys` lists them (the ID column)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a key id; ids start at 1")
    return value


def add_usage(sub: Any) -> None:
    p = command(
        sub,
        "usage",
        "requests and tokens per day, gateway key and model",
        "Usage of your own gateway keys (a team admin's: their teams' too; staff's and "
        "viewers': everyone's), per day (UTC), key and "
        "model asked for, newest day first, with the totals. The gateway writes it every few "
        "seconds. For a spreadsheet: GET LLMGW_URL/api/v1/usage?format=csv (the console's "
        "Usage page has the link).",
        run=cmd_usage,
    )
    p.add_argument("--key", type=_key_id, help="one key's ID, as `llmgw ctl keys` lists it")
    p.add_argument("--model", help="one model or adapter")
    p.add_argument("--since", type=_day, metavar="DATE", help="from this day on, YYYY-MM-DD")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_usage(client: Client, args: argparse.Namespace) -> None:
    rows = client.get(
        "usage",
        key=args.key,
        model=args.model,
        since=args.since.isoformat() if args.since else None,
    )
    if not table_wanted(
        args,
        rows,
        "No usage recorded for those keys and models yet (the gateway writes it every few seconds).",
    ):
        return
    days = [
        [
            r["day"],
            f"{r['key']} ({r['key_prefix']}…, {r['key_name']})",
            r["owner"],
            r["model"],
            f"{r['requests']:,}",
            f"{r['prompt_tokens']:,}",
            f"{r['completion_tokens']:,}",
        ]
        for r in rows
    ]
    total = [
        "total",
        "",
        "",
        "",
        f"{sum(r['requests'] for r in rows):,}",
        f"{sum(r['prompt_tokens'] for r in rows):,}",
        f"{sum(r['completion_tokens'] for r in rows):,}",
    ]
    header = [
        "DAY (UTC)",
        "KEY",
        "OWNER",
        "MODEL",
        "REQUESTS",
        "PROMPT TOKENS",
        "COMPLETION TOKENS",
    ]
    print(table([*days, total], header))


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a day; write it as YYYY-MM-DD") from None


def _when(value: str | None, never: str = "never") -> str:
    return value[:19].replace("T", " ") if value else never

"""`llmgw ctl teams` and `team`: the teams that share a fleet's limits, their members and usage."""

from __future__ import annotations

import argparse
from typing import Any

from llmgw.client import Client, CtlError

from .commands import command
from .limits import COUNTERS, add_limit_flags, limit_lines, limits_body, limits_summary
from .output import print_json, program, table, table_wanted

TEAMS_HELP = """\
A team groups users whose keys share limits: a team's limits count all its keys
together, and each key's own limits (at most the team's) count that key alone.
Staff add teams and set their limits, members, team admins and key policy
(llmgw ctl key policy team:NAME); a team admin sets their team's members and
manages the keys in it (llmgw ctl keys lists them); a user sees the teams they
are in, and puts their keys into them (llmgw ctl key limits ID --team TEAM). A
member keeps their keys in their teams with limits or a key policy."""


def add_teams(sub: Any) -> None:
    p = command(
        sub,
        "teams",
        "the teams: yours (staff: every team), with their limits",
        TEAMS_HELP,
        run=cmd_teams,
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_teams(client: Client, args: argparse.Namespace) -> None:
    teams = client.get("teams")
    none = f"No teams yet. Staff add one with: {program()} ctl team add NAME [--rpm N ...]"
    if not table_wanted(args, teams, none):
        return
    rows = [
        [
            t["name"],
            str(len(t["members"])),
            str(t["keys"]),
            f"{t['usage']['tokens_today']:,}",
            limits_summary(t["limits"]),
        ]
        for t in teams
    ]
    print(table(rows, ["NAME", "MEMBERS", "KEYS", "TOKENS TODAY", "LIMITS"]))


def add_team(sub: Any) -> None:
    team = command(
        sub, "team", "add teams, set their limits and members (staff), show one", TEAMS_HELP
    )
    tsub = team.add_subparsers(dest="team_command", required=True, metavar="COMMAND")
    p = command(
        tsub,
        "add",
        "add a team (staff)",
        "NAME follows the catalog's name rules (letters, digits, '.', '_', '-', ':').",
        run=cmd_team_add,
    )
    p.add_argument("name")
    add_limit_flags(p, key=False)
    p.add_argument(
        "--member", action="append", default=[], metavar="USER", help="a member (repeatable)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(
        tsub,
        "limits",
        "change a team's limits (staff)",
        "A flag not given leaves that limit as it is; 0 or none lifts it. The "
        "gateway holds them within a second.",
        run=cmd_team_limits,
    )
    p.add_argument("name")
    add_limit_flags(p, key=False)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(
        tsub,
        "members",
        "add and remove a team's members (staff and its team admins)",
        "A member removed keeps their keys in the team, held to its limits, until "
        "they or staff move them (llmgw ctl key limits ID --team none), and loses "
        "their roles in it. Staff give and take away the team admin role "
        "(--add-admin, --remove-admin); a team admin changes the team's members "
        "and manages the keys in it.",
        run=cmd_team_members,
    )
    p.add_argument("name")
    p.add_argument("--add", action="append", default=[], metavar="USER", help="repeatable")
    p.add_argument("--remove", action="append", default=[], metavar="USER", help="repeatable")
    p.add_argument(
        "--add-admin",
        action="append",
        default=[],
        metavar="USER",
        help="give the team admin role (staff; makes them a member); repeatable",
    )
    p.add_argument(
        "--remove-admin",
        action="append",
        default=[],
        metavar="USER",
        help="take the team admin role away (staff; they stay a member); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(
        tsub, "show", "a team's limits, members and usage against each limit", run=cmd_team_show
    )
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(
        tsub,
        "remove",
        "remove a team (staff); its keys stay, without the team's limits",
        run=cmd_team_remove,
    )
    p.add_argument("name")


def cmd_team_add(client: Client, args: argparse.Namespace) -> None:
    body = {"name": args.name, **limits_body(args)}
    if args.member:
        body["members"] = _users(args.member)
    _print_team(client.post("teams", body), args, f"Team {args.name} added:")


def cmd_team_limits(client: Client, args: argparse.Namespace) -> None:
    team = client.request("PATCH", f"teams/{args.name}", json=limits_body(args))
    _print_team(
        team, args, f"Team {team['name']} now:", then="The gateway holds these within a second."
    )


def cmd_team_members(client: Client, args: argparse.Namespace) -> None:
    if not (args.add or args.remove or args.add_admin or args.remove_admin):
        raise CtlError("say whom: --add USER or --remove USER (each may be repeated)")
    body = {"add": _users(args.add), "remove": _users(args.remove)}
    if args.add_admin or args.remove_admin:
        body.update(add_admins=_users(args.add_admin), remove_admins=_users(args.remove_admin))
    team = client.post(f"teams/{args.name}/members", body)
    if args.json:
        print_json(team)
        return
    members = ", ".join(team["members"]) or "none"
    print(f"Team {team['name']} has {len(team['members'])} member(s): {members}.")
    if team.get("admins"):
        print(f"Its team admins: {', '.join(team['admins'])}.")


def cmd_team_show(client: Client, args: argparse.Namespace) -> None:
    team = client.get(f"teams/{args.name}")
    _print_team(team, args, f"Team {team['name']}:")


def cmd_team_remove(client: Client, args: argparse.Namespace) -> None:
    gone = client.delete(f"teams/{args.name}")
    print(
        f"Team {gone['name']} removed; its {gone['keys']} key(s) stay, without the team's limits."
    )


def _print_team(team: dict[str, Any], args: argparse.Namespace, title: str, then: str = "") -> None:
    if args.json:
        print_json(team)
        return
    print(title)
    print(f"  {'members':<17} {', '.join(team['members']) or 'none'}")
    if team.get("admins"):
        print(f"  {'team admins':<17} {', '.join(team['admins'])}")
    print(f"  {'keys':<17} {team['keys']} active")
    print(*limit_lines(team), sep="\n")
    policy = team.get("policy")
    if policy:
        print(f"  {'key policy':<17} {policy_summary(policy)}")
    if then:
        print(then)


def policy_summary(policy: dict[str, Any]) -> str:
    """A key policy on one line: "rpm default 60, ceiling 100; tokens-per-day ceiling 10,000"."""
    parts = []
    for field in COUNTERS:
        default, ceiling = policy["defaults"][field], policy["ceilings"][field]
        figures = [f"default {default:,}"] if default is not None else []
        figures += [f"ceiling {ceiling:,}"] if ceiling is not None else []
        if figures:
            parts.append(f"{field.replace('_', '-')} {', '.join(figures)}")
    return "; ".join(parts) or "no defaults or ceilings"


def _users(names: list[str]) -> list[str]:
    # --add alice,bob reads as two users, as --add alice --add bob does.
    return [n.strip() for name in names for n in name.split(",") if n.strip()]

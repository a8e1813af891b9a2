"""`llmgw ctl login` and `logout`: an API token of one's own through the company's sign-in.

The control plane asks its OpenID Connect provider for a device authorization (RFC 8628) and
polls the provider for the command (signin.device); the command prints the address and the
code to enter there, waits, and keeps the token it is given (llmgw.credentials): owner-only,
expiring, listed on the console's API tokens page, where it can be revoked.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Any

from llmgw import credentials
from llmgw.client import Client, CtlError

from .commands import command
from .output import print_json, program

LOGIN_HELP = """\
Signs you in through the control plane's identity provider (your company's
sign-in) and keeps an API token for this control plane in
~/.config/llmgw/login.json (only you can read it). The command prints an address
and a code: open the address in any browser, sign in, enter the code. The token
expires (the control plane says when) and is listed on the console's API tokens
page, where you can revoke it; `llmgw ctl logout` revokes it too. LLMGW_TOKEN
and --token still come first, so scripts keep the tokens they have."""

# The longest a login waits, whatever the provider says (it says 5 to 30 minutes).
MAX_WAIT_SECONDS = 30 * 60


def add_login(sub: Any) -> None:
    p = command(sub, "login", "sign in through your company's identity provider", LOGIN_HELP)
    p.set_defaults(run=cmd_login)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p = command(
        sub,
        "logout",
        "revoke the token `login` kept for this control plane, and forget it",
        run=cmd_logout,
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def cmd_login(client: Client, args: argparse.Namespace) -> None:
    anonymous = Client(url=client.url, token="", timeout=client.timeout)
    machine = platform.node()[:100]
    started = anonymous.post("login/device", {"client": machine} if machine else {})
    shown = started.get("verification_uri_complete") or started["verification_uri"]
    print(
        f"To sign in to {client.url}, open this address in a browser:\n\n  {shown}\n\n"
        f"and check that it shows the code {started['user_code']}.",
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    interval = max(1, int(started.get("interval") or 5))
    deadline = time.monotonic() + min(int(started.get("expires_in") or 600), MAX_WAIT_SECONDS)
    while True:
        time.sleep(interval)  # the provider's polling interval, RFC 8628 section 3.5
        answer = anonymous.post("login/device/poll", {"login": started["login"]})
        if answer.get("status") == "done":
            break
        interval = max(interval, int(answer.get("interval") or interval))
        if time.monotonic() > deadline:
            raise CtlError(
                f"nobody signed in with the code in time; run `{program()} ctl login` again"
            )
    path = credentials.save(
        client.url,
        token=answer["token"],
        username=answer["username"],
        expires_at=answer.get("expires_at"),
    )
    if args.json:
        print_json({k: answer.get(k) for k in ("username", "expires_at", "token_id")})
        return
    print(
        f"Signed in to {client.url} as {answer['username']}. The token expires at "
        f"{answer.get('expires_at') or 'never'}; it is kept in {path} (only you can read it). "
        f"`{program()} ctl logout` revokes it."
    )


def cmd_logout(client: Client, args: argparse.Namespace) -> None:
    kept = credentials.token_for(client.url)
    if not kept:
        raise CtlError(f"no login is kept for {client.url}; nothing to revoke")
    try:
        revoked = Client(url=client.url, token=kept, timeout=client.timeout).delete(
            "tokens/current"
        )
    except CtlError as exc:
        # Forgotten all the same: a token the control plane refuses is no use to keep.
        credentials.forget(client.url)
        raise CtlError(
            f"the control plane did not revoke the token ({exc}); it is forgotten here"
        ) from None
    credentials.forget(client.url)
    if args.json:
        print_json({"revoked": revoked})
        return
    print(f"Signed out of {client.url}: token {revoked['prefix']}… revoked and forgotten.")

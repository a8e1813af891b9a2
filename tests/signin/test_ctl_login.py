"""`llmgw ctl login` end to end: the command, run as a person runs it, against the control plane
and a real OpenID Connect provider (oidc-provider), the person approving its code on the
provider's device page; then the token it kept, its refusals, `logout`, and a leaver."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from django.contrib.auth import get_user_model

from accounts.models import ApiToken, DeviceLogin
from catalog.models import AuditEntry
from signin.models import Identity
from tests.signin.real_provider import use_provider
from tests.support.oidc_provider import OidcProvider, oidc_provider_fixture  # noqa: F401
from tests.support.system import ROOT
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# The command prints the code at once; the provider's polling interval is 5 s.
LOGIN_TIMEOUT = 90


@pytest.fixture
def signin(
    oidc_provider: OidcProvider, live_server: Any, settings: Any, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    from signin.oidc import forget_providers

    use_provider(
        oidc_provider,
        settings,
        tmp_path,
        redirect_uris=[f"{live_server.url}/signin/callback"],
        group_map="ml=member:research, ml-leads=team-admin:research",
    )
    settings.LLMGW_PUBLIC_URL = live_server.url
    person = f"ada-{uuid.uuid4().hex[:6]}"
    oidc_provider.put_user(
        person,
        email=f"{person}@example.com",
        name="Ada L",
        preferred_username=person,
        groups=["ml"],
    )
    home = tmp_path / "config"
    yield {"url": live_server.url, "person": person, "home": home, "provider": oidc_provider}
    forget_providers()


def ctl(url: str, home: Path, *args: str) -> subprocess.Popen[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("LLMGW_TOKEN", "LLMGW_URL")}
    environment["XDG_CONFIG_HOME"] = str(home)
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", "ctl", "--url", url, *args],
        cwd=ROOT,
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_code(process: subprocess.Popen[str]) -> str:
    """The code the command prints for the person to check, read as it prints it (its output
    is read on a thread, so that the rest of it is there for communicate())."""
    assert process.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(
            lambda: "shows the code " in "".join(lines) or process.poll() is not None,
            timeout=LOGIN_TIMEOUT,
            what="the command to print its code",
        )
    finally:
        if process.poll() is not None:
            reader.join()
    seen = "".join(lines)
    assert "shows the code " in seen, f"it stopped: {seen}{process.stderr.read()}"  # type: ignore[union-attr]
    process.printed = lines  # type: ignore[attr-defined]
    process.reader = reader  # type: ignore[attr-defined]
    return seen.split("shows the code ")[1].split()[0].rstrip(".")


def finish(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Waits for the command to end: what it printed, its errors."""
    try:
        process.wait(timeout=LOGIN_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    process.reader.join()  # type: ignore[attr-defined]
    return "".join(process.printed), process.stderr.read()  # type: ignore[attr-defined, union-attr]


def login(world: dict[str, Any], username: str) -> tuple[str, str]:
    process = ctl(world["url"], world["home"], "login")
    try:
        code = read_code(process)
        world["provider"].approve_device(code, username)
    finally:
        out, err = finish(process)
    assert process.returncode == 0, err
    return code, out


def test_a_person_signs_in_from_the_command_line_and_the_token_it_keeps_works(
    signin: dict[str, Any],
) -> None:
    person = signin["person"]
    _, out = login(signin, person)
    assert f"as {person}." in out and "only you can read it" in out
    kept = signin["home"] / "llmgw" / "login.json"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    user = get_user_model().objects.get(username=person)
    assert user.email == f"{person}@example.com"
    assert list(user.llmgw_teams.values_list("name", flat=True)) == ["research"]
    (token,) = ApiToken.objects.filter(user=user)
    assert token.expires_at is not None and token.name.startswith("llmgw ctl login")
    assert not DeviceLogin.objects.exists()  # one token per login, and the row is gone
    assert AuditEntry.objects.filter(model_name=f"user {person}", action="sign-in").exists()
    # The command's next calls use the kept token: `keys` answers as the person.
    listed = ctl(signin["url"], signin["home"], "keys", "--json")
    out, err = listed.communicate(timeout=60)
    assert listed.returncode == 0, err
    # `logout` revokes it at the control plane and forgets it here.
    out_process = ctl(signin["url"], signin["home"], "logout")
    out, err = out_process.communicate(timeout=60)
    assert out_process.returncode == 0, err
    assert "revoked and forgotten" in out
    assert not ApiToken.objects.filter(user=user).exists()
    again = ctl(signin["url"], signin["home"], "keys")
    _, err = again.communicate(timeout=60)
    assert again.returncode == 1 and "Log in first" in err and "llmgw ctl login" in err


def test_the_poll_refuses_what_it_should_and_changes_nothing(signin: dict[str, Any]) -> None:
    url = signin["url"]
    refused = requests.post(f"{url}/api/v1/login/device/poll", json={"login": "x" * 43}, timeout=30)
    assert refused.status_code == 404 and "llmgw ctl login" in refused.json()["detail"]
    unknown = requests.post(f"{url}/api/v1/login/device", json={"clinet": "x"}, timeout=30)
    assert unknown.status_code == 400 and "client" in unknown.text
    started = requests.post(f"{url}/api/v1/login/device", json={"client": "laptop"}, timeout=30)
    assert started.status_code == 200
    body = started.json()
    assert body["verification_uri"].startswith(signin["provider"].issuer)
    # Nobody has signed in yet: pending, and asked again at once it does not ask the provider.
    first = requests.post(
        f"{url}/api/v1/login/device/poll", json={"login": body["login"]}, timeout=30
    )
    second = requests.post(
        f"{url}/api/v1/login/device/poll", json={"login": body["login"]}, timeout=30
    )
    assert (first.status_code, second.status_code) == (202, 202)
    assert second.json() == {"status": "pending", "interval": body["interval"]}
    assert not ApiToken.objects.exists()


def test_a_person_whose_groups_map_to_no_role_gets_no_token(signin: dict[str, Any]) -> None:
    stranger = f"eve-{uuid.uuid4().hex[:6]}"
    signin["provider"].put_user(stranger, preferred_username=stranger, groups=["sales"])
    process = ctl(signin["url"], signin["home"], "login")
    try:
        code = read_code(process)
        signin["provider"].approve_device(code, stranger)
    finally:
        _, err = finish(process)
    assert process.returncode == 1 and "map to no role" in err
    assert not get_user_model().objects.filter(username=stranger).exists()
    assert not ApiToken.objects.exists()
    assert not (signin["home"] / "llmgw" / "login.json").exists()


def test_a_leaver_loses_their_sessions_tokens_and_keys_at_the_next_check(
    signin: dict[str, Any], settings: Any
) -> None:
    from access.services import key_create
    from core.actor import Actor
    from signin.leavers import check_members
    from tests.gateway.conftest import GatewayServer

    person = signin["person"]
    login(signin, person)
    user = get_user_model().objects.get(username=person)
    # Signed in in a browser too, and a gateway key of theirs answered by a running gateway.
    browser = requests.Session()
    start = browser.get(f"{signin['url']}/signin/start", allow_redirects=False, timeout=30)
    landed = browser.get(
        signin["provider"].sign_in(browser, start.headers["Location"], person), timeout=30
    )
    assert landed.status_code == 200 and person in landed.text
    key = key_create(actor=Actor.for_user(user, "api"), name="app")[1]
    gateway = GatewayServer(lifespan=True)

    def answered(expected: int) -> bool:
        headers = {"Authorization": f"Bearer {key}"}
        return (
            requests.get(f"{gateway.url}/v1/models", headers=headers, timeout=10).status_code
            == expected
        )

    try:
        wait_for(lambda: answered(200), timeout=60, what="the gateway to know the key")
        leaves(signin, settings, user, person, check_members)
        assert (
            browser.get(f"{signin['url']}/", allow_redirects=False, timeout=30).status_code == 302
        )
        wait_for(lambda: answered(401), timeout=60, what="the leaver's gateway key to be refused")
    finally:
        gateway.stop()


def leaves(
    signin: dict[str, Any], settings: Any, user: Any, person: str, check_members: Any
) -> None:
    identity = Identity.objects.get(user=user)
    assert identity.refresh_token  # offline_access: the provider can be asked again
    # Still there: the check brings their groups up to date and nothing else.
    settings.LLMGW_OIDC_RECHECK_SECONDS = 0
    signin["provider"].put_user(
        person, preferred_username=person, email=f"{person}@example.com", groups=["ml", "ml-leads"]
    )
    run = check_members()
    assert (run.checked, run.left, run.stopped) == (1, [], "")
    identity.refresh_from_db()
    assert identity.groups == ["ml", "ml-leads"]
    # Removed at the provider: the next check finds out and they leave.
    signin["provider"].remove_user(person)
    run = check_members()
    assert run.left == [person]
    user.refresh_from_db()
    assert not user.is_active
    assert not ApiToken.objects.filter(user=user).exists()
    entry = AuditEntry.objects.get(model_name=f"user {person}", action="leaver")
    assert "no longer accepts" in entry.note and entry.actor_name == "system"
    assert "1 session(s) ended" in entry.note
    # The token the command kept is refused now.
    keys = ctl(signin["url"], signin["home"], "keys")
    _, err = keys.communicate(timeout=60)
    assert keys.returncode == 1 and "Invalid token" in err

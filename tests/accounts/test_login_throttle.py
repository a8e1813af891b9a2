"""Password logins (console and admin) are throttled per username and, apart, per address."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]

HERE, THERE = "10.0.0.5", "10.0.0.9"


def log_in(path: str, username: str, password: str, address: str = HERE, **headers: Any) -> Any:
    return Client().post(
        path, {"username": username, "password": password}, REMOTE_ADDR=address, **headers
    )


def test_wrong_passwords_lock_that_username_from_every_address(users: dict[str, Any]) -> None:
    answers = [log_in("/login/", "alice", "wrong").status_code for _ in range(5)]
    # The form again with its error, and the fifth failure locks.
    assert answers == [200, 200, 200, 200, 429]
    locked = log_in("/login/", "alice", "alice-password-1", address=THERE)
    assert locked.status_code == 429
    page = locked.content.decode()
    assert "Too many failed logins" in page
    assert "5 wrong passwords were given for <strong>alice</strong>, from any address" in page
    assert "Its API tokens still work" in page
    assert "manage.py axes_reset_username alice" in page
    # The right password does not log in while the account is locked, from anywhere.
    assert "sessionid" not in locked.cookies
    assert log_in("/login/", "alice", "alice-password-1").status_code == 429


def test_a_new_address_buys_no_fresh_guesses(users: dict[str, Any]) -> None:
    # One guess from each of five addresses, as a botnet would.
    answers = [
        log_in("/login/", "alice", "wrong", address=f"198.51.100.{n}").status_code for n in range(5)
    ]
    assert answers == [200, 200, 200, 200, 429]
    assert log_in("/login/", "alice", "alice-password-1", address=THERE).status_code == 429


def test_spraying_one_guess_per_username_locks_the_address(users: dict[str, Any]) -> None:
    for name in ("alice", "bob", "carol", "staff"):
        assert log_in("/login/", name, "Password1").status_code == 200
    assert log_in("/login/", "dave", "Password1").status_code == 429
    refused = log_in("/login/", "bob", "bob-password-1")
    assert refused.status_code == 429
    page = refused.content.decode()
    assert "5 wrong passwords were given from your address, for any account" in page
    assert f"manage.py axes_reset_ip {HERE}" in page
    # The accounts themselves are not locked: from elsewhere, each logs in.
    assert log_in("/login/", "bob", "bob-password-1", address=THERE).status_code == 302


def test_a_spoofed_forwarded_for_buys_no_fresh_guesses(users: dict[str, Any]) -> None:
    # Sent straight to Django: the count is kept on the peer (REMOTE_ADDR), never on a header
    # the client wrote, whatever axes would read through django-ipware.
    answers = [
        log_in("/login/", f"user{n}", "wrong", HTTP_X_FORWARDED_FOR=f"203.0.113.{n}").status_code
        for n in range(5)
    ]
    assert answers == [200, 200, 200, 200, 429]
    refused = log_in("/login/", "bob", "bob-password-1", HTTP_X_FORWARDED_FOR="203.0.113.99")
    assert refused.status_code == 429


def test_the_address_is_the_peer_even_with_ipware_settings(settings: Any) -> None:
    from axes.helpers import get_client_ip_address
    from django.test import RequestFactory

    settings.AXES_IPWARE_META_PRECEDENCE_ORDER = ("HTTP_X_FORWARDED_FOR", "REMOTE_ADDR")
    request = RequestFactory().post("/login/", REMOTE_ADDR=HERE, HTTP_X_FORWARDED_FOR="203.0.113.7")
    assert get_client_ip_address(request, use_ipware=True) == HERE


def test_the_admin_login_is_throttled_too(users: dict[str, Any]) -> None:
    for _ in range(4):
        assert log_in("/admin/login/", "staff", "wrong").status_code == 200
    assert log_in("/admin/login/", "staff", "wrong").status_code == 429
    assert log_in("/admin/login/", "staff", "staff-password-1").status_code == 429
    # The count is shared with the console login: it is the account's.
    assert log_in("/login/", "staff", "staff-password-1", address=THERE).status_code == 429


def test_a_good_login_clears_the_count(users: dict[str, Any]) -> None:
    for _ in range(4):
        log_in("/login/", "carol", "wrong")
    assert log_in("/login/", "carol", "carol-password-1").status_code == 302
    for _ in range(4):
        log_in("/login/", "carol", "wrong")
    assert log_in("/login/", "carol", "carol-password-1").status_code == 302


def test_logging_into_ones_own_account_does_not_clear_the_guesses_at_another(
    users: dict[str, Any],
) -> None:
    # bob guesses at alice's password and logs into his own account in between: the failures
    # from his address and those for alice stay counted.
    for _ in range(4):
        assert log_in("/login/", "alice", "wrong").status_code == 200
    assert log_in("/login/", "bob", "bob-password-1").status_code == 302
    assert log_in("/login/", "alice", "wrong").status_code == 429
    assert log_in("/login/", "alice", "alice-password-1", address=THERE).status_code == 429


def test_trying_again_while_locked_does_not_prolong_the_lockout(
    users: dict[str, Any], settings: Any
) -> None:
    from datetime import timedelta

    from axes.models import AccessAttempt
    from django.utils import timezone

    for _ in range(5):
        log_in("/login/", "alice", "wrong")
    assert log_in("/login/", "alice", "alice-password-1").status_code == 429
    assert log_in("/login/", "alice", "wrong", address=THERE).status_code == 429
    # Counted: the five, and nothing after the lockout.
    assert sum(a.failures_since_start for a in AccessAttempt.objects.all()) == 5
    # Once the cool-off has passed since the fifth, the right password logs in.
    AccessAttempt.objects.update(attempt_time=timezone.now() - timedelta(minutes=16))
    assert log_in("/login/", "alice", "alice-password-1").status_code == 302


def test_a_lockout_by_others_leaves_the_api_token_and_the_session_working(
    users: dict[str, Any], api: Any
) -> None:
    browser = Client()
    assert (
        browser.post(
            "/login/", {"username": "alice", "password": "alice-password-1"}, REMOTE_ADDR=THERE
        ).status_code
        == 302
    )
    for _ in range(5):
        log_in("/login/", "alice", "wrong")
    assert log_in("/login/", "alice", "alice-password-1", address=THERE).status_code == 429
    # alice proves herself with her token, and with the session she already had.
    answer = api("alice").get("/api/v1/models", REMOTE_ADDR=HERE)
    assert answer.status_code == 200, answer.content
    assert browser.get("/", REMOTE_ADDR=THERE).status_code == 200
    assert browser.get("/api/v1/models", REMOTE_ADDR=THERE).status_code == 200


def test_the_limit_is_a_setting(users: dict[str, Any], settings: Any) -> None:
    settings.AXES_FAILURE_LIMIT = 2
    assert log_in("/login/", "bob", "wrong").status_code == 200
    assert log_in("/login/", "bob", "wrong").status_code == 429
    assert log_in("/login/", "bob", "bob-password-1", address=THERE).status_code == 429

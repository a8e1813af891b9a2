"""Password logins (console and admin) are throttled per username and address, in the database."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]

HERE, THERE = "10.0.0.5", "10.0.0.9"


def log_in(path: str, username: str, password: str, address: str = HERE) -> Any:
    return Client().post(path, {"username": username, "password": password}, REMOTE_ADDR=address)


def test_wrong_passwords_lock_that_username_from_that_address(users: dict[str, Any]) -> None:
    answers = [log_in("/login/", "alice", "wrong").status_code for _ in range(5)]
    # The form again with its error, and the fifth failure locks.
    assert answers == [200, 200, 200, 200, 429]
    locked = log_in("/login/", "alice", "alice-password-1")
    assert locked.status_code == 429
    assert "Too many failed logins" in locked.content.decode()
    assert "5 wrong passwords in a row were given for <strong>alice</strong>" in (
        locked.content.decode()
    )
    assert log_in("/login/", "alice", "wrong").status_code == 429
    # Someone else at that address, and alice elsewhere, are not locked out.
    assert log_in("/login/", "bob", "bob-password-1").status_code == 302
    assert log_in("/login/", "alice", "alice-password-1", address=THERE).status_code == 302


def test_the_admin_login_is_throttled_too(users: dict[str, Any]) -> None:
    for _ in range(4):
        assert log_in("/admin/login/", "staff", "wrong").status_code == 200
    assert log_in("/admin/login/", "staff", "wrong").status_code == 429
    assert log_in("/admin/login/", "staff", "staff-password-1").status_code == 429
    # The count is shared with the console login: it is the account and the address.
    assert log_in("/login/", "staff", "staff-password-1").status_code == 429


def test_a_good_login_clears_the_count(users: dict[str, Any]) -> None:
    for _ in range(4):
        log_in("/login/", "carol", "wrong")
    assert log_in("/login/", "carol", "carol-password-1").status_code == 302
    for _ in range(4):
        log_in("/login/", "carol", "wrong")
    assert log_in("/login/", "carol", "carol-password-1").status_code == 302


def test_the_limit_is_a_setting(users: dict[str, Any], settings: Any) -> None:
    settings.AXES_FAILURE_LIMIT = 2
    assert log_in("/login/", "bob", "wrong").status_code == 200
    assert log_in("/login/", "bob", "wrong").status_code == 429
    assert log_in("/login/", "bob", "bob-password-1").status_code == 429

"""What every console page shares: a login first, the CSRF token, htmx served from here."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from catalog.models import Model
from tests.console.pages import HTMX, text_of

pytestmark = [pytest.mark.django_db]


@pytest.mark.smoke
@pytest.mark.parametrize("url", ["/", "/models/x/", "/nodes/", "/audit/", "/add/"])
def test_it_sends_strangers_to_log_in(url: str) -> None:
    response = Client().get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


def test_an_htmx_request_after_the_session_ended_reloads_to_the_login_page() -> None:
    response = Client().post("/models/tiny-chat/scale", {"min": 2}, headers=HTMX)
    assert response.status_code == 200
    assert response["HX-Redirect"] == "/login/?next=%2Fmodels%2Ftiny-chat%2F"


def test_it_logs_in_with_a_django_account(users: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    page = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert token
    response = client.post(
        "/login/",
        {"username": "alice", "password": "alice-password-1", "csrfmiddlewaretoken": token[1]},
    )
    assert response.status_code == 302
    assert client.get("/").status_code == 200


def test_a_wrong_password_is_told(users: Any) -> None:
    response = Client().post("/login/", {"username": "alice", "password": "nope"})
    assert "That username and password do not match an account." in text_of(response)


def test_posts_need_the_csrf_token(client_for: Any, running: Any, users: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(users["alice"])
    assert client.post("/models/tiny-chat/scale", {"min": 2}).status_code == 403
    assert Model.objects.get(name="tiny-chat").min_replicas == 1


def test_pages_carry_the_csrf_header_and_htmx_2_served_here(client_for: Any) -> None:
    html = client_for("alice").get("/").content.decode()
    assert 'hx-headers=\'{"X-CSRFToken": "' in html
    assert "/static/django_htmx/htmx-2" in html
    # Every script and stylesheet comes from our own static files, none from a CDN (the page's
    # random CSRF token can contain the letters "cdn", so look at the addresses only).
    addresses = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert addresses and all(a.startswith("/") or a.startswith("#") for a in addresses), addresses

"""The API tokens page: a person's own tokens, expired ones marked, each revocable by them alone."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import ApiToken
from accounts.services import token_create

pytestmark = pytest.mark.django_db


def test_it_lists_ones_own_tokens_and_revokes_them(users: dict[str, Any]) -> None:
    laptop, _ = token_create(
        user=users["alice"],
        name="llmgw ctl login on laptop",
        expires_at=timezone.now() + timedelta(days=30),
    )
    old, _ = token_create(
        user=users["alice"], name="old script", expires_at=timezone.now() - timedelta(days=1)
    )
    bobs, _ = token_create(user=users["bob"], name="bob's script")
    browser = Client()
    browser.force_login(users["alice"])
    page = browser.get("/tokens/").content.decode()
    assert "llmgw ctl login on laptop" in page and "old script" in page
    assert "bob&#x27;s script" not in page and "bob's script" not in page
    assert page.count("<strong>expired</strong>") == 1
    assert 'href="/tokens/" aria-current="page"' in page
    answer = browser.post(f"/tokens/{laptop.pk}/revoke", follow=True).content.decode()
    assert "is revoked" in answer and not ApiToken.objects.filter(pk=laptop.pk).exists()
    # Another's token is not theirs to revoke: nothing changes.
    answer = browser.post(f"/tokens/{bobs.pk}/revoke", follow=True).content.decode()
    assert "You have no API token" in answer and ApiToken.objects.filter(pk=bobs.pk).exists()
    assert browser.get(f"/tokens/{old.pk}/revoke").status_code == 405
    assert ApiToken.objects.filter(pk=old.pk).exists()

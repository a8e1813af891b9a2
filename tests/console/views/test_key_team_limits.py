"""A key in a limited team, on the Keys page: where the key has no limit of its own, the card
shows the team's, which is what binds it, rather than "no limit"."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from access.models import GatewayKey, KeyUsageDay
from access.services import key_create, team_add, team_set_limits
from core.actor import Actor
from tests.console.pages import KEY_LIMITS_UNCHANGED, text_of

pytestmark = [pytest.mark.django_db]

HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/keys/"}


@pytest.fixture
def research(users: dict[str, Any]) -> None:
    team_add(
        actor=Actor.for_user(users["staff"], "api"),
        name="research",
        limits={"rpm": 60, "tokens_per_day": 10_000, "models": ["llama-*"]},
        members=["alice"],
    )


def in_research(users: dict[str, Any], **limits: Any) -> GatewayKey:
    return key_create(
        actor=Actor.for_user(users["alice"], "api"),
        name="notebook",
        team="research",
        limits=limits,
    )[0]


def limits_line(text: str) -> str:
    start = text.index("requests today")
    return text[start : text.index("weight", start)]


def test_it_shows_the_teams_limit_where_the_key_has_none(
    client_for: Any, users: dict[str, Any], research: None
) -> None:
    key = in_research(users)
    KeyUsageDay.objects.create(
        key=key, model="m", day=datetime.now(UTC).date(), requests=3, prompt_tokens=200
    )

    text = text_of(client_for("alice").get("/keys/"))

    line = limits_line(text)
    assert "Requests per minute: 60 (team)" in line
    assert "Tokens per minute: no limit" in line  # neither the key nor its team has one
    assert "models: llama-* (team)" in line
    assert "Requests per minute: no limit" not in text
    assert "Tokens today 200; the team's limit 10,000, all its keys together" in text


def test_it_shows_the_keys_own_limit_and_the_teams_where_that_is_lower(
    client_for: Any, users: dict[str, Any], research: None
) -> None:
    in_research(users, rpm=30)
    line = limits_line(text_of(client_for("alice").get("/keys/")))
    assert "Requests per minute: 30 ·" in line

    team_set_limits(
        actor=Actor.for_user(users["staff"], "api"), name="research", changes={"rpm": 20}
    )
    line = limits_line(text_of(client_for("alice").get("/keys/")))
    assert "Requests per minute: 20 (team; the key's own 30)" in line


def test_the_card_an_htmx_change_answers_with_shows_the_team_too(
    client_for: Any, users: dict[str, Any], research: None
) -> None:
    key = in_research(users)
    form = {**KEY_LIMITS_UNCHANGED, "team": "research", "max_parallel": "2"}
    response = client_for("alice").post(f"/keys/{key.pk}/limits", form, headers=HTMX)
    assert response.status_code == 200, text_of(response)
    text = text_of(response)
    assert "Requests per minute: 60 (team)" in limits_line(text)
    assert "Requests in flight: 2" in limits_line(text)

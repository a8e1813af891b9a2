"""The API's schema and docs page answer those logged in (a token or a console session), and
anonymous visitors only when LLMGW_PUBLIC_API_DOCS=true."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from django.test import Client

from llmgw_site.api_docs import LOGIN_NEEDED

pytestmark = pytest.mark.django_db


def test_it_refuses_the_schema_to_anonymous_with_how_to_log_in() -> None:
    response = Client().get("/api/v1/schema")
    assert response.status_code == 401
    assert response.json() == {"detail": LOGIN_NEEDED, "code": "not_authenticated"}
    assert response["WWW-Authenticate"] == "Token"
    assert "LLMGW_PUBLIC_API_DOCS=true" in LOGIN_NEEDED and "/login/" in LOGIN_NEEDED


def test_it_refuses_the_docs_page_to_anonymous_with_a_login_link() -> None:
    response = Client().get("/api/v1/docs")
    assert response.status_code == 401
    page = response.content.decode()
    assert '<a href="/login/?next=/api/v1/docs">Log in</a>' in page
    assert "LLMGW_PUBLIC_API_DOCS=true opens them to everyone" in page
    assert "swagger" not in page.lower()


def test_a_wrong_token_is_refused_as_anywhere_else() -> None:
    response = Client().get("/api/v1/schema", HTTP_AUTHORIZATION="Bearer not-a-token")
    assert response.status_code == 401
    assert response.json()["code"] == "authentication_failed"


def test_a_token_reads_the_schema(tokens: dict[str, str]) -> None:
    response = Client().get("/api/v1/schema", HTTP_AUTHORIZATION=f"Bearer {tokens['alice']}")
    assert response.status_code == 200
    assert "/api/v1/models" in yaml.safe_load(response.content)["paths"]


def test_a_console_session_reads_the_docs_and_the_schema_they_load(users: dict[str, Any]) -> None:
    browser = Client()
    browser.force_login(users["bob"])
    docs = browser.get("/api/v1/docs")
    assert docs.status_code == 200
    assert "swagger-ui" in docs.content.decode()
    # The page's script fetches the schema with the same session cookie.
    schema = browser.get("/api/v1/schema")
    assert schema.status_code == 200
    assert yaml.safe_load(schema.content)["info"]["title"] == "llmgw control plane API"


def test_public_api_docs_opens_both_to_anonymous(settings: Any) -> None:
    settings.LLMGW_PUBLIC_API_DOCS = True
    assert Client().get("/api/v1/docs").status_code == 200
    response = Client().get("/api/v1/schema")
    assert response.status_code == 200
    assert "/api/v1/models" in yaml.safe_load(response.content)["paths"]
    # Only the map: the operations themselves still need a login.
    assert Client().get("/api/v1/models").status_code == 401

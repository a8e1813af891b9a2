"""How a write that meets a full disk is answered, through the real middleware and handlers:
the API (a DRF view), a page and an htmx request of the console, each writing a file in
LLMGW_VAR_DIR on a small tmpfs filled to the last byte (tests.support.tmpfs).

The whole product on a full disk is tests/llmgw_site/test_full_disk.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from tests.support.tmpfs import fill, mounted_tmpfs

pytestmark = pytest.mark.urls(__name__)


def _write_a_note() -> None:
    with open(Path(settings.VAR_DIR) / "note", "wb", buffering=0) as out:
        out.write(b"n" * 65536)


class WriteAPI(APIView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []

    def post(self, request: Request) -> Response:
        _write_a_note()
        return Response({"written": True})


def write_page(request: HttpRequest) -> HttpResponse:
    _write_a_note()
    return HttpResponse("written")


urlpatterns = [path("api/v1/write", WriteAPI.as_view()), path("console/write", write_page)]


@pytest.fixture
def full_var(tmp_path: Path, settings: Any) -> Any:
    with mounted_tmpfs(tmp_path / "var", size_mb=1) as folder:
        settings.VAR_DIR = folder
        filler = fill(folder)
        yield folder
        filler.unlink()


def sentence(folder: Path) -> str:
    return (
        f"Nothing was changed: the disk holding llmgw's files ({folder}) is full: 0 B free of "
        f"1.00 MB. Free some space there (old files in {folder / 'log'}, models no longer "
        "served), then try again; llmgw needs no restart."
    )


def test_the_api_answers_507_in_its_error_shape(client: Any, full_var: Path) -> None:
    answer = client.post("/api/v1/write", {}, content_type="application/json")
    assert answer.status_code == 507
    assert answer["Retry-After"] == "30"
    assert answer.json() == {"detail": sentence(full_var), "code": "disk_full"}


def test_a_console_page_answers_507_with_the_sentence(client: Any, full_var: Path) -> None:
    answer = client.post("/console/write")
    assert answer.status_code == 507
    assert answer["Retry-After"] == "30"
    page = answer.content.decode()
    assert "<h1>The disk is full</h1>" in page
    assert sentence(full_var).replace("'", "&#x27;") in page


def test_an_htmx_request_gets_the_sentence_alone(client: Any, full_var: Path) -> None:
    answer = client.post("/console/write", headers={"HX-Request": "true"})
    assert answer.status_code == 507
    assert answer["Content-Type"] == "text/plain; charset=utf-8"
    assert answer.content.decode() == sentence(full_var)


def test_with_room_again_the_same_write_works(client: Any, full_var: Path) -> None:
    (full_var / "filler").unlink()
    (full_var / "filler").touch()  # the fixture deletes it again
    answer = client.post("/api/v1/write", {}, content_type="application/json")
    assert (answer.status_code, answer.json()) == (200, {"written": True})

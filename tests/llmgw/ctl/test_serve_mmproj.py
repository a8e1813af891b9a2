"""`llmgw ctl model serve --mmproj`: the projector is fetched with the weights, and a name that
is not a file of the repository is refused in the API's words."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catalog.models import Model
from llmgw.cli import main
from llmgw.tinygguf import write_tiny_mmproj, write_tiny_model
from registry.models import Fetch
from tests.support.registry import LocalRegistry, available

REPO = "acme/tiny-vision"


@pytest.fixture
def registry(tmp_path: Path, server_yaml: Any) -> Iterator[LocalRegistry]:
    reason = available()
    if reason:
        pytest.skip(reason)
    write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    write_tiny_mmproj(tmp_path / "mmproj.gguf", seed=1)
    with LocalRegistry(tmp_path / "registry") as running:
        running.commit(
            REPO,
            {
                "tiny-vision-q4.gguf": tmp_path / "tiny.gguf",
                "mmproj.gguf": tmp_path / "mmproj.gguf",
            },
        )
        server_yaml(
            {"registry": {"endpoint": running.endpoint}, "mirror": {"root": str(tmp_path / "m")}}
        )
        yield running


@pytest.mark.django_db(transaction=True)
def test_serve_asks_for_the_projector_with_the_weights(
    registry: LocalRegistry, live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv("LLMGW_URL", live_server.url)
    monkeypatch.setenv("LLMGW_TOKEN", tokens["alice"])
    # No worker runs here: the fetch stays queued, which is all this test needs of it.
    code = main(["ctl", "model", "serve", REPO, "--mmproj", "mmproj.gguf", "--timeout", "1"])
    out, _ = capsys.readouterr()
    assert code == 1
    commit = registry.head(REPO)
    assert out.splitlines()[0] == (
        f"Fetching tiny-vision-q4.gguf, mmproj.gguf from {REPO} at {commit[:7]} (main) into the mirror"
    )
    fetch = Fetch.objects.get()
    assert [f["path"] for f in fetch.files] == ["tiny-vision-q4.gguf", "mmproj.gguf"]
    assert fetch.serve_definition["mmproj"] == "mmproj.gguf"


@pytest.mark.django_db(transaction=True)
def test_serve_refuses_a_projector_name_that_is_no_file_name(
    registry: LocalRegistry, live_server: Any, tokens: dict[str, str], capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv("LLMGW_URL", live_server.url)
    monkeypatch.setenv("LLMGW_TOKEN", tokens["alice"])
    code = main(["ctl", "model", "serve", REPO, "--mmproj", "../other/mmproj.gguf"])
    _, err = capsys.readouterr()
    assert code == 1
    assert "'../other/mmproj.gguf' is not a projector file" in err
    assert not Fetch.objects.exists() and not Model.objects.exists()

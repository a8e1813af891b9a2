"""`llmgw ctl model plan` shows a memory estimate in a unit that shows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from llmgw.cli import main
from llmgw.tinygguf import write_tiny_model
from llmgw.units import format_bytes
from tests.factories import definition
from tests.support.http_files import serve_directory


@pytest.mark.django_db(transaction=True)
def test_plan_shows_a_small_model_in_kb_or_mb(
    live_server: Any,
    tokens: dict[str, str],
    capsys: Any,
    monkeypatch: Any,
    settings: Any,
    tmp_path: Path,
) -> None:
    write_tiny_model(tmp_path / "tiny.gguf", seed=1, context_length=2048)
    monkeypatch.setenv("LLMGW_URL", live_server.url)
    monkeypatch.setenv("LLMGW_TOKEN", tokens["alice"])
    with serve_directory(tmp_path) as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        path = tmp_path / "model.yaml"
        text = yaml.safe_dump(definition(source=f"{base_url}/tiny.gguf", context_length=1024))
        path.write_text(text)
        code = main(["ctl", "model", "plan", "-f", str(path)])
        estimate = api_estimate(live_server, tokens, path)
    out, err = capsys.readouterr()
    assert code == 0, err
    size = (tmp_path / "tiny.gguf").stat().st_size
    kv = 2 * 1024 * 2 * 16 * 2 * 2  # layers x tokens x KV heads x dims x (K, V) x 2 bytes
    prompt_cache = estimate["prompt_cache_bytes"]
    assert estimate["weights_bytes"] == size and estimate["kv_cache_bytes"] == kv
    assert (
        f"  memory estimate: {format_bytes(size + kv + prompt_cache)} (weights "
        f"{format_bytes(size)} + KV cache {format_bytes(kv)} for 1 x 1024 tokens + prompt cache "
        f"{format_bytes(prompt_cache)})"
    ) in out
    assert "0.00 GB" not in out


def api_estimate(live_server: Any, tokens: dict[str, str], path: Path) -> dict[str, Any]:
    import requests

    response = requests.post(
        f"{live_server.url}/api/v1/plan",
        data=path.read_bytes(),
        headers={"Authorization": f"Token {tokens['alice']}", "Content-Type": "application/yaml"},
        timeout=30,
    )
    return response.json()["estimate"]


@pytest.mark.parametrize(
    "size, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KB"),
        (5 * 1024**2, "5.00 MB"),
        (3 * 1024**3, "3.00 GB"),
        (2 * 1024**4, "2.00 TB"),
    ],
)
def test_sizes_are_shown_in_the_largest_unit_that_keeps_them_at_one_or_more(
    size: int, text: str
) -> None:
    assert format_bytes(size) == text

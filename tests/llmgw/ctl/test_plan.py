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


def _gpu_node(users: dict[str, Any], name: str, devices: list[dict[str, Any]], backends: list[str]):
    """A node that has sent a heartbeat, with the devices and engine backends its agent reports
    (written directly: their storage from the heartbeat is another piece's)."""
    from django.utils import timezone

    from core.actor import Actor
    from fleet.models import Node
    from fleet.services import node_add

    node, _token = node_add(actor=Actor.for_user(users["staff"], "api"), name=name)
    Node.objects.filter(pk=node.pk).update(
        memory_gb=16,
        cores=4,
        last_heartbeat=timezone.now(),
        heard_since=timezone.now(),
        devices=devices,
        devices_source="nvml",
        engine_backends=backends,
    )


def _plan_gpu(tmp_path: Path, capsys: Any, **profile: Any) -> str:
    path = tmp_path / "model.yaml"
    gpu = {"name": "gpu", "memory_gb": 1, "gpus": 1, "gpu_memory_gb": 6, **profile}
    path.write_text(yaml.safe_dump(definition(source="http://127.0.0.1:9/x.gguf", profiles=[gpu])))
    code = main(["ctl", "model", "plan", "-f", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _device(index: int, total_mb: int, used_mb: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA L4",
        "memory_total_mb": total_mb,
        "memory_used_mb": used_mb,
        "utilization_pct": None,
    }


@pytest.mark.django_db(transaction=True)
def test_plan_says_a_gpu_profile_needs_a_node_with_a_gpu_engine(
    live_server: Any,
    users: dict[str, Any],
    tokens: dict[str, str],
    capsys: Any,
    monkeypatch: Any,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("LLMGW_URL", live_server.url)
    monkeypatch.setenv("LLMGW_TOKEN", tokens["alice"])
    _gpu_node(users, "cpu-box", [_device(0, 24576, 0)], ["CPU"])
    out = _plan_gpu(tmp_path, capsys)
    assert (
        "  1 could not be placed: no node has a GPU engine (an engine built with CUDA): "
        "profile gpu needs 1 GPU, and the engine of every schedulable node (cpu-box) has only "
        "its CPU backend. On a machine with NVIDIA GPUs, build the engine with "
        "`LLMGW_ENGINE=cuda make setup`"
    ) in out


@pytest.mark.django_db(transaction=True)
def test_plan_shows_the_gpus_chosen_or_each_devices_figures(
    live_server: Any,
    users: dict[str, Any],
    tokens: dict[str, str],
    capsys: Any,
    monkeypatch: Any,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("LLMGW_URL", live_server.url)
    monkeypatch.setenv("LLMGW_TOKEN", tokens["alice"])
    # Device 0: another program holds 20 of its 24 GB.
    _gpu_node(users, "g", [_device(0, 24576, 20480), _device(1, 24576, 1024)], ["CPU", "CUDA"])
    out = _plan_gpu(tmp_path, capsys)
    assert "  would run on g GPU 1 (6 GB) (profile gpu)" in out
    out = _plan_gpu(tmp_path, capsys, gpu_memory_gb=12, gpus=2)
    assert (
        "  1 could not be placed: no node has 2 GPUs with 12 GB of GPU memory free each for "
        "profile gpu; the closest is g (GPU 0: 24 GB, 0 GB reserved by llmgw, 20 GB used by "
        "other programs, 4 GB free; GPU 1: 24 GB, 0 GB reserved by llmgw, 1 GB used by other "
        "programs, 23 GB free)"
    ) in out
    assert (
        "    g GPU 0: 24 GB, 0 GB reserved by llmgw, 20 GB used by other programs, 4 GB free; "
        "needs 12 GB"
    ) in out

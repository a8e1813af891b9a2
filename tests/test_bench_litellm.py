"""The benches compare against one LiteLLM: bench/gateway.py installs litellm[proxy] at an exact
version, and a venv holding another version (from before the pin) is installed over, not used."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import gateway


def fake_venv(folder: Path, version: str) -> None:
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "litellm").write_text("#!/bin/sh\n")
    (folder / "lib" / "python3.11" / "site-packages" / f"litellm-{version}.dist-info").mkdir(
        parents=True
    )


def test_the_version_is_exact() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", gateway.LITELLM_VERSION)


@pytest.mark.parametrize("present", [None, "1.50.0"])
def test_it_installs_the_pinned_version_unless_it_is_there(
    tmp_path: Path, monkeypatch: Any, present: str | None
) -> None:
    venv = tmp_path / "litellm venv"
    if present:
        fake_venv(venv, present)
    monkeypatch.setattr(gateway, "LITELLM_VENV", venv)
    started: list[list[str]] = []

    def popen(argv: list[str], **_: Any) -> str:
        started.append(argv)
        return "installing"

    monkeypatch.setattr(subprocess, "Popen", popen)
    assert gateway.litellm_install() == "installing"
    [(shell, _, command)] = started
    assert shell == "sh"
    assert f"install --quiet 'litellm[proxy]=={gateway.LITELLM_VERSION}'" in command
    assert f"'{venv}/bin/pip'" in command  # quoted: the folder's name has a space


def test_the_pinned_version_in_place_is_used(tmp_path: Path, monkeypatch: Any) -> None:
    fake_venv(tmp_path, gateway.LITELLM_VERSION)
    monkeypatch.setattr(gateway, "LITELLM_VENV", tmp_path)
    assert gateway.litellm_installed()
    assert gateway.litellm_install() is None

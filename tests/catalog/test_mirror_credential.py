"""The control plane's credential for its own mirror goes to its own origin only."""

from __future__ import annotations

from typing import Any


def test_the_control_plane_sends_its_credential_to_its_own_mirror_only(settings: Any) -> None:
    import requests

    from catalog.mirror_credential import ControlPlaneAuth, is_control_plane_token

    settings.LLMGW_PUBLIC_URL = "http://127.0.0.1:8000"
    own = requests.Request("GET", "http://127.0.0.1:8000/mirror/a/b/c/w.gguf").prepare()
    header = ControlPlaneAuth()(own).headers["Authorization"]
    assert header.startswith("Bearer ") and is_control_plane_token(header.removeprefix("Bearer "))
    elsewhere = requests.Request("GET", "http://127.0.0.1:9000/mirror/a/b/c/w.gguf").prepare()
    assert "Authorization" not in ControlPlaneAuth()(elsewhere).headers
    assert not is_control_plane_token("guess")

"""The tokens `llmgw ctl login` keeps: owner-only, one per control plane, sent only to it."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from llmgw import credentials
from llmgw.client import Client, CtlError

pytestmark = pytest.mark.smoke

HERE, THERE = "http://127.0.0.1:8000", "https://llm.example.com"


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("LLMGW_TOKEN", raising=False)
    monkeypatch.delenv("LLMGW_URL", raising=False)
    return tmp_path


def test_a_kept_token_is_the_owners_alone_and_goes_only_to_its_control_plane(
    config_home: Path,
) -> None:
    later = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    path = credentials.save(HERE, token="llmgw_here", username="alice", expires_at=later)
    assert path == config_home / "llmgw" / "login.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert credentials.token_for(HERE) == "llmgw_here"
    assert credentials.token_for(THERE) is None
    assert Client(url=HERE).token == "llmgw_here"
    assert Client(url=THERE).token == ""
    # LLMGW_TOKEN and --token come first: scripts keep the tokens they have.
    os.environ["LLMGW_TOKEN"] = "llmgw_script"
    try:
        assert Client(url=HERE).token == "llmgw_script"
    finally:
        del os.environ["LLMGW_TOKEN"]
    assert Client(url=HERE, token="llmgw_flag").token == "llmgw_flag"
    assert Client(url=HERE, token="").token == ""


def test_an_expired_token_is_not_sent() -> None:
    earlier = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    credentials.save(HERE, token="llmgw_old", username="alice", expires_at=earlier)
    assert credentials.token_for(HERE) is None
    assert Client(url=HERE).token == ""


def test_a_file_others_may_read_is_not_used_and_the_error_says_how_to_fix_it() -> None:
    path = credentials.save(HERE, token="llmgw_here", username="alice", expires_at=None)
    path.chmod(0o644)
    with pytest.raises(CtlError, match=r"may be read by others.*chmod 600"):
        Client(url=HERE)
    # Signing in again writes it anew, owner-only, without the old tokens.
    credentials.save(THERE, token="llmgw_there", username="alice", expires_at=None)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert credentials.token_for(HERE) is None
    assert credentials.token_for(THERE) == "llmgw_there"


def test_forgetting_one_login_keeps_the_others() -> None:
    credentials.save(HERE, token="llmgw_here", username="alice", expires_at=None)
    credentials.save(THERE, token="llmgw_there", username="alice", expires_at=None)
    assert credentials.forget(HERE) == {
        "token": "llmgw_here",
        "username": "alice",
        "expires_at": None,
    }
    assert credentials.forget(HERE) is None
    assert credentials.token_for(THERE) == "llmgw_there"


def test_a_damaged_file_is_an_error_that_says_what_to_do(config_home: Path) -> None:
    path = config_home / "llmgw" / "login.json"
    path.parent.mkdir(mode=0o700)
    path.write_text("{not json")
    path.chmod(0o600)
    with pytest.raises(credentials.CredentialsError, match="not JSON; remove it"):
        credentials.token_for(HERE)

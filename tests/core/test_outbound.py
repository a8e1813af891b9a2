"""The host check on every fetch the control plane makes, against real servers on 127.0.0.1.

Each test has an allowed server and an "internal" one that is not allowed, reached by the
name localhost so that the two differ by name as well as by port; the internal one must
never see a request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from catalog.config import ConfigError, load_config, parse_config
from catalog.models import AuditEntry, Model
from core.outbound import AllowedHost, HostPolicy, URLRefused, parse_target
from llmgw.tinygguf import write_lora_adapter, write_tiny_model
from registry import fetches
from registry.hub import Registry, RegistryError
from registry.models import Fetch
from tests.factories import definition
from tests.support.http_files import ServerStats, serve_directory
from tests.support.redirects import serve_redirects

pytestmark = pytest.mark.django_db


@pytest.fixture
def internal(tmp_path: Path) -> Iterator[tuple[str, ServerStats]]:
    """A server the allow-list does not name, holding a model file; yields (base URL, stats)."""
    folder = tmp_path / "internal"
    folder.mkdir()
    write_tiny_model(folder / "tiny.gguf", seed=1)
    with serve_directory(folder) as (base_url, stats):
        yield base_url.replace("127.0.0.1", "localhost"), stats


@pytest.fixture
def allowed(tmp_path: Path, settings: Any) -> Iterator[str]:
    """The allowed server, with a model and an adapter for it; the allow-list names only it."""
    folder = tmp_path / "allowed"
    folder.mkdir()
    write_tiny_model(folder / "tiny.gguf", seed=1)
    write_lora_adapter(folder / "sql.gguf", seed=2)
    with serve_directory(folder) as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        yield base_url


@pytest.fixture
def redirect_to_internal(
    internal: tuple[str, ServerStats], settings: Any
) -> Iterator[tuple[str, ServerStats]]:
    """An allowed server that redirects every request to the internal one."""
    with serve_redirects(f"{internal[0]}/") as (base_url, _stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        yield base_url, internal[1]


def test_a_backslash_cannot_make_the_client_connect_elsewhere(
    api: Any, allowed: str, internal: tuple[str, ServerStats]
) -> None:
    # urllib.parse reads the allowed host after the backslash; requests connects to the
    # host before it.
    internal_url, stats = internal
    source = f"{internal_url}\\@{urlsplit(allowed).netloc}/tiny.gguf"
    response = api("alice").post("/api/v1/models", definition(source=source), format="json")
    assert response.status_code == 400, response.json()
    assert "it contains a backslash" in response.json()["detail"]
    plan = api("alice").post("/api/v1/plan", definition(source=source), format="json")
    assert plan.status_code == 400
    assert stats.request_count == 0
    assert Model.objects.count() == 0


def test_a_source_check_does_not_follow_a_redirect_to_a_host_not_allowed(
    api: Any, redirect_to_internal: tuple[str, ServerStats]
) -> None:
    base_url, internal_stats = redirect_to_internal
    response = api("alice").post(
        "/api/v1/models", definition(source=f"{base_url}/tiny.gguf"), format="json"
    )
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "source_host_not_allowed"
    assert body["detail"].startswith(f"The source {base_url}/tiny.gguf redirects to ")
    assert "is not in sources.allowed_hosts in server.yaml" in body["detail"]
    assert internal_stats.request_count == 0


def test_plan_does_not_read_a_header_past_a_redirect_to_a_host_not_allowed(
    api: Any, redirect_to_internal: tuple[str, ServerStats]
) -> None:
    base_url, internal_stats = redirect_to_internal
    plan = api("alice").post(
        "/api/v1/plan", definition(source=f"{base_url}/tiny.gguf"), format="json"
    )
    assert plan.status_code == 200
    assert plan.json()["estimate"] is None
    [warning] = plan.json()["warnings"]
    assert warning.startswith("memory not estimated: The control plane may not fetch")
    assert "is not in sources.allowed_hosts" in warning
    assert internal_stats.request_count == 0


def test_an_adapter_check_does_not_read_the_model_past_a_redirect(
    api: Any, allowed: str, internal: tuple[str, ServerStats], settings: Any
) -> None:
    internal_url, internal_stats = internal
    with serve_redirects(f"{internal_url}/") as (redirecting, _):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [
            urlsplit(allowed).netloc,
            urlsplit(redirecting).netloc,
        ]
        added = api("alice").post(
            "/api/v1/models?source_check=false",
            definition(source=f"{redirecting}/tiny.gguf"),
            format="json",
        )
        assert added.status_code == 201
        response = api("alice").post(
            "/api/v1/models/tiny-chat/adapters",
            {"add": [{"name": "tiny-sql", "source": f"{allowed}/sql.gguf"}]},
            format="json",
        )
    assert response.status_code == 400
    assert response.json()["code"] == "source_host_not_allowed"
    assert Model.objects.get().adapters == []
    assert internal_stats.request_count == 0


def test_registry_calls_do_not_follow_a_redirect_to_a_host_not_allowed(
    redirect_to_internal: tuple[str, ServerStats], settings: Any
) -> None:
    base_url, internal_stats = redirect_to_internal
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = []  # only the registry's own host
    with pytest.raises(RegistryError, match=r"may not fetch .* is not in sources\.allowed_hosts"):
        Registry(endpoint=base_url).branch_heads("acme/tiny-chat")
    assert internal_stats.request_count == 0


def test_a_mirror_fetch_does_not_follow_a_redirect_to_a_host_not_allowed(
    redirect_to_internal: tuple[str, ServerStats], server_yaml: Any, settings: Any, tmp_path: Path
) -> None:
    base_url, internal_stats = redirect_to_internal
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = []
    server_yaml({"registry": {"endpoint": base_url}, "mirror": {"root": str(tmp_path / "m")}})
    fetch = Fetch.objects.create(
        repo="acme/tiny-chat",
        commit="0" * 40,
        files=[{"path": "tiny.gguf", "size": 10, "sha256": "a" * 64}],
        bytes_total=10,
    )
    fetches.run_fetch(fetch.pk)
    fetch.refresh_from_db()
    assert fetch.state == Fetch.FAILED
    assert fetch.message.startswith("the download of tiny.gguf was refused: ")
    assert "is not in sources.allowed_hosts" in fetch.message
    assert internal_stats.request_count == 0
    assert not list((tmp_path / "m").rglob("*.gguf"))


@pytest.mark.parametrize(
    "url, reason",
    [
        ("http://127.0.0.1:8000\\@evil/x.gguf", "backslash"),
        ("http://127.0.0.1:8000@evil/x.gguf", "user name or password"),
        ("http://user:pw@127.0.0.1:8000/x.gguf", "user name or password"),
        ("http://127.0.0.1%3A8000/x.gguf", "not written plainly"),
        ("http://mirror.internal./x.gguf", "not written plainly"),
        ("http://mirror..internal/x.gguf", "not written plainly"),
        ("http://127.0.0.1: 8000/x.gguf", "a space"),
        ("http://127.0.0.1:8000/x.gguf\n", "a control character"),
        ("http://\uff4dirror.internal/x.gguf", "non-ASCII"),
        ("http://127.1:8000/x.gguf", "unusual form"),
        ("http://2130706433:8000/x.gguf", "unusual form"),
        ("http://0x7f.0.0.1:8000/x.gguf", "unusual form"),
        ("http://[fe80::1%25eth0]:8000/x.gguf", "not written plainly"),
        ("http://127.0.0.1:99999/x.gguf", "not a port"),
        ("http://127.0.0.1:/x.gguf", "not written plainly"),
        ("ftp://127.0.0.1/x.gguf", "only http and https"),
    ],
)
def test_ambiguous_urls_are_refused_before_anything_is_sent(url: str, reason: str) -> None:
    with pytest.raises(URLRefused, match=reason):
        HostPolicy(("127.0.0.1:8000", "mirror.internal", "evil")).check(url)


@pytest.mark.parametrize(
    "entry, url, allowed",
    [
        ("[::1]:8731", "http://[::1]:8731/x.gguf", True),
        ("[::1]:8731", "http://[0:0:0:0:0:0:0:1]:8731/x.gguf", True),
        ("[::1]:8731", "http://[::1]:8732/x.gguf", False),
        ("::1", "http://[::1]:9000/x.gguf", True),
        ("127.0.0.1:8000", "http://127.0.0.1:8000/x.gguf", True),
        ("127.0.0.1:8000", "http://127.0.0.1:8001/x.gguf", False),
        ("Mirror.Internal", "http://mirror.internal:81/x.gguf", True),
        ("mirror.internal:80", "http://mirror.internal/x.gguf", True),
        ("mirror.internal:80", "https://mirror.internal/x.gguf", False),
        ("mirror.internal:443", "https://mirror.internal/x.gguf", True),
        ("*.hf.co", "https://cdn-lfs.hf.co/x", True),
        ("*.hf.co", "https://hf.co/x", False),
        ("*.hf.co", "https://evilhf.co/x", False),
        ("127.0.0.1", "http://127.0.0.1.evil/x", False),
    ],
)
def test_allow_list_entries_match_by_host_and_port(entry: str, url: str, allowed: bool) -> None:
    policy = HostPolicy((entry,))
    if allowed:
        policy.check(url)
    else:
        with pytest.raises(URLRefused, match=r"is not in sources\.allowed_hosts"):
            policy.check(url)


def test_ipv6_entries_parse() -> None:
    assert AllowedHost.parse("[::1]:8731") == AllowedHost("::1", 8731)
    assert parse_target("http://[::1]:8731/x").address == "[::1]:8731"


def test_a_bad_allow_list_entry_stops_the_start_with_its_line(tmp_path: Path) -> None:
    text = "sources:\n  allowed_hosts:\n    - 127.0.0.1:8000\n    - http://mirror/\n"
    with pytest.raises(ConfigError) as error:
        parse_config(text, tmp_path / "server.yaml")
    assert str(error.value) == (
        f"{tmp_path / 'server.yaml'}: sources.allowed_hosts: 'http://mirror/' is not a host: write "
        "host, host:port, [IPv6]:port or *.domain, without scheme or path (line 2)"
    )


def test_a_bad_allow_list_in_the_environment_stops_the_start(tmp_path: Path, settings: Any) -> None:
    settings.LLMGW_SOURCE_ALLOWED_HOSTS = ["[::1"]
    with pytest.raises(ConfigError, match=r"^LLMGW_SOURCE_ALLOWED_HOSTS: '\[::1' is not a host"):
        load_config(tmp_path / "server.yaml")


def test_nothing_is_written_when_a_source_is_refused(api: Any, allowed: str) -> None:
    response = api("alice").post(
        "/api/v1/models", definition(source="http://user@127.0.0.1/x.gguf"), format="json"
    )
    assert response.status_code == 400
    assert Model.objects.count() == 0
    assert AuditEntry.objects.count() == 0


def test_a_registry_endpoint_with_a_password_stops_the_start(tmp_path: Path) -> None:
    text = "registry:\n  endpoint: https://user:secret@hub.internal\n"
    with pytest.raises(ConfigError, match="user name or password before the host") as error:
        parse_config(text, tmp_path / "server.yaml")
    assert "secret" not in str(error.value)


def test_a_refusal_does_not_repeat_a_password() -> None:
    with pytest.raises(URLRefused) as refused:
        parse_target("https://user:secret@hub.internal/x")
    assert "secret" not in str(refused.value)
    assert "'https://…@hub.internal/x'" in str(refused.value)


def test_a_registry_that_never_answers_is_given_up_on(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    import socket
    import threading

    from huggingface_hub.utils import _http as hf_http

    from registry import hub

    monkeypatch.setattr(hub, "TIMEOUT_SECONDS", 1.0)
    hf_http.close_session()  # the next call makes the client again, with the short timeout
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # takes connections, never answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = []
        outcome: list[BaseException] = []

        def ask() -> None:
            try:
                Registry(endpoint=endpoint).branch_heads("acme/tiny-chat")
            except RegistryError as exc:
                outcome.append(exc)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(timeout=30)
    hf_http.close_session()
    assert not asking.is_alive(), "the registry call is still waiting"
    assert outcome and "could not list the branches" in str(outcome[0])

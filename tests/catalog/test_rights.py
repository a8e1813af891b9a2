"""Who may do what: rights are asked first, before any lookup or fetch an outsider could learn
from, and the installation-wide actions are staff's. The README's Security section says the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from catalog.models import AuditEntry, Model
from llmgw.tinygguf import write_lora_adapter, write_tiny_model
from tests.factories import definition
from tests.support.http_files import serve_directory

pytestmark = pytest.mark.django_db

NO_CHECK = "/api/v1/models?source_check=false"
BELONGS = "tiny-chat belongs to alice; only they or a staff user may change it."


@pytest.fixture
def alices_model(api: Any) -> None:
    response = api("alice").post(
        NO_CHECK, definition(min_replicas=0, max_replicas=1), format="json"
    )
    assert response.status_code == 201, response.json()


def test_an_outsider_cannot_tell_which_usernames_exist(api: Any, alices_model: None) -> None:
    for username in ("carol", "nobody-by-this-name"):
        response = api("bob").post(
            "/api/v1/models/tiny-chat/owner", {"owner": username}, format="json"
        )
        assert response.status_code == 403, response.json()
        assert response.json()["detail"].startswith(BELONGS)
    # The owner does learn it: the account must exist before a model is handed to it.
    response = api("alice").post(
        "/api/v1/models/tiny-chat/owner", {"owner": "nobody-by-this-name"}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["code"] == "unknown_user"
    assert Model.objects.get().owner.username == "alice"


def test_an_outsider_makes_the_control_plane_fetch_nothing(
    api: Any, alices_model: None, tmp_path: Path, settings: Any
) -> None:
    write_tiny_model(tmp_path / "tiny.gguf", seed=1)
    write_lora_adapter(tmp_path / "sql.gguf", seed=2)
    with serve_directory(tmp_path) as (base_url, stats):
        settings.LLMGW_SOURCE_ALLOWED_HOSTS = [urlsplit(base_url).netloc]
        body = {"add": [{"name": "sql", "source": f"{base_url}/sql.gguf"}]}
        response = api("bob").post("/api/v1/models/tiny-chat/adapters", body, format="json")
        assert response.status_code == 403, response.json()
        assert response.json()["detail"].startswith(BELONGS)
    assert stats.request_count == 0
    assert Model.objects.get().adapters == []


def test_an_outsider_is_refused_before_learning_a_model_is_declared(
    api: Any, server_yaml: Any, users: dict[str, Any]
) -> None:
    from catalog.config import current_config
    from catalog.services import config_apply

    server_yaml({"models": [definition(name="declared-chat", owner="alice")]})
    config_apply(current_config())
    for path, body in (
        ("scale", {"min": 2}),
        ("class", {"class": "critical"}),
        ("resources", {"memory_gb": 2}),
    ):
        response = api("bob").post(f"/api/v1/models/declared-chat/{path}", body, format="json")
        assert response.status_code == 403, (path, response.json())
    assert api("bob").delete("/api/v1/models/declared-chat").status_code == 403
    # Its owner is told why the change cannot be made here.
    response = api("alice").post("/api/v1/models/declared-chat/scale", {"min": 2}, format="json")
    assert response.status_code == 409 and response.json()["code"] == "declared_model"


def test_an_outsiders_fallback_does_not_keep_a_model_from_its_owner(
    api: Any, alices_model: None
) -> None:
    response = api("bob").post(
        NO_CHECK, definition(name="bobs-chat", fallbacks=["tiny-chat"]), format="json"
    )
    assert response.status_code == 201, response.json()
    # Naming it as a fallback gives bob no say over alice's model: she changes it as before,
    for path, body in (
        ("scale", {"min": 0, "max": 0}),
        ("class", {"class": "critical"}),
        ("resources", {"memory_gb": 2}),
    ):
        response = api("alice").post(f"/api/v1/models/tiny-chat/{path}", body, format="json")
        assert response.status_code == 200, (path, response.json())
    # and removes it; bob's model loses the fallback, in the same change.
    assert api("alice").delete("/api/v1/models/tiny-chat").status_code == 204
    assert not Model.objects.filter(name="tiny-chat").exists()
    assert Model.objects.get(name="bobs-chat").fallbacks == []
    entry = AuditEntry.objects.get(action="fallback-dropped")
    assert (entry.model_name, entry.actor_name, entry.door) == ("bobs-chat", "alice", "api")
    assert entry.note == "bobs-chat no longer falls back to tiny-chat: alice removed it"
    assert entry.changes == {"fallbacks": [["tiny-chat"], None]}
    # Bob sees why his model changed in its audit.
    audit = api("bob").get("/api/v1/audit", {"model": "bobs-chat"}).json()["entries"]
    assert [e["action"] for e in audit] == ["fallback-dropped", "add"]


def test_a_fallback_declared_in_server_yaml_is_the_operators_to_drop(
    api: Any, alices_model: None, server_yaml: Any
) -> None:
    from catalog.config import current_config
    from catalog.services import config_apply

    path = server_yaml({"models": [definition(name="declared-chat", fallbacks=["tiny-chat"])]})
    config_apply(current_config())
    response = api("alice").delete("/api/v1/models/tiny-chat")
    assert response.status_code == 409
    assert response.json() == {
        "detail": f"tiny-chat cannot be removed: declared-chat falls back to it and is declared "
        f"in {path}. Ask an administrator to take tiny-chat out of those fallbacks in {path} "
        "first.",
        "code": "fallback_target",
    }
    assert Model.objects.get(name="declared-chat").fallbacks == ["tiny-chat"]
    assert not AuditEntry.objects.filter(action__in=["remove", "fallback-dropped"]).exists()


def test_a_declared_model_gone_from_server_yaml_leaves_no_fallback_behind(
    api: Any, server_yaml: Any
) -> None:
    from catalog.config import current_config
    from catalog.services import config_apply

    server_yaml({"models": [definition(name="declared-chat")]})
    config_apply(current_config())
    response = api("bob").post(
        NO_CHECK, definition(name="bobs-chat", fallbacks=["declared-chat"]), format="json"
    )
    assert response.status_code == 201, response.json()
    path = server_yaml({"models": []})
    assert config_apply(current_config())["removed"] == ["declared-chat"]
    assert Model.objects.get(name="bobs-chat").fallbacks == []
    entry = AuditEntry.objects.get(action="fallback-dropped")
    assert (entry.model_name, entry.actor_name, entry.door) == ("bobs-chat", "config", "config")
    assert entry.note == f"bobs-chat no longer falls back to declared-chat: gone from {path}"
    # Bob's model is whole again: his own changes pass the catalog's checks.
    response = api("bob").post("/api/v1/models/bobs-chat/scale", {"min": 2}, format="json")
    assert response.status_code == 200, response.json()


def test_only_the_owner_or_staff_ask_for_a_model_to_be_loaded(api: Any, alices_model: None) -> None:
    response = api("bob").post("/api/v1/models/tiny-chat/demand")
    assert response.status_code == 403
    assert response.json()["detail"].startswith(BELONGS)
    assert Model.objects.get().demand_at is None
    assert api("alice").post("/api/v1/models/tiny-chat/demand").status_code == 200
    assert api("staff").post("/api/v1/models/tiny-chat/demand").status_code == 200
    assert Model.objects.get().demand_at is not None


def test_node_addresses_are_shown_to_staff_only(api: Any) -> None:
    from fleet.models import Node

    api("staff").post("/api/v1/nodes", {"name": "n1"}, format="json")
    Node.objects.filter(name="n1").update(address="10.0.0.7")
    assert api("staff").get("/api/v1/nodes").json()[0]["address"] == "10.0.0.7"
    seen_by_bob = api("bob").get("/api/v1/nodes").json()[0]
    assert seen_by_bob["name"] == "n1" and seen_by_bob["address"] is None


def test_the_update_check_asks_only_about_the_askers_own_models(
    api: Any, users: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from registry import updates

    asked: list[str] = []

    class Registry:
        requests = 0

        def branch_heads(self, repo: str) -> dict[str, str]:
            asked.append(repo)
            self.requests += 1
            return {}

    monkeypatch.setattr(updates, "Registry", Registry)
    origin = {"repo": "", "branch": "main", "commit": "a" * 40, "files": []}
    for name, owner in (("alice-model", "alice"), ("carol-model", "carol")):
        Model.objects.create(
            name=name,
            owner=users[owner],
            source=f"http://127.0.0.1:8000/mirror/acme/{name}/{'a' * 40}/w.gguf",
            profiles=[{"name": "cpu", "memory_gb": 1, "cores": 1}],
            origin={**origin, "repo": f"acme/{name}"},
        )
    assert api("bob").post("/api/v1/updates/check").json()["repositories"] == 0
    assert api("alice").post("/api/v1/updates/check").json()["repositories"] == 1
    assert asked == ["acme/alice-model"]
    assert api("staff").post("/api/v1/updates/check").json()["repositories"] == 2


def test_every_user_reads_the_whole_audit(api: Any, alices_model: None) -> None:
    # Deliberately open to every logged-in user: it holds the definitions every user can
    # already read, and who changed (or preempted) a shared model is what teammates need.
    entries = api("bob").get("/api/v1/audit").json()["entries"]
    assert [(e["actor"], e["action"]) for e in entries] == [("alice", "add")]
    assert AuditEntry.objects.count() == 1

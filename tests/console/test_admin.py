"""The admin: every catalog and fleet model listed, and changes made through the same services."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from django.test import Client

from catalog.models import AuditEntry, Model
from fleet.models import Node
from fleet.reconciler import reconcile_pass
from tests.factories import definition

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def root(users: Any) -> Any:
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_superuser("root", password="root-password-1")


@pytest.fixture
def admin_client(root: Any) -> Client:
    client = Client()
    client.force_login(root)
    return client


def text_of(response: Any) -> str:
    html = response.content.decode()
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&#x27;", "'")


def add_form(text: str, skip: bool = True) -> dict[str, Any]:
    data: dict[str, Any] = {"definition_yaml": text}
    if skip:
        data["skip_source_check"] = "on"
    return data


def change_form(model: Model, **overrides: Any) -> dict[str, Any]:
    wanted = {**model.definition(), **overrides}
    return add_form(yaml.safe_dump(wanted, sort_keys=False))


@pytest.mark.parametrize(
    "path",
    [
        "catalog/model",
        "catalog/auditentry",
        "registry/rollout",
        "registry/fetch",
        "registry/mirrorfile",
        "catalog/catalogversion",
        "fleet/node",
        "fleet/replica",
        "fleet/lease",
    ],
)
def test_every_catalog_and_fleet_model_is_listed(
    admin_client: Client, fleet: Any, path: str
) -> None:
    fleet.node("node-a")
    fleet.add("tiny-chat")
    reconcile_pass()
    response = admin_client.get(f"/admin/{path}/?q=tiny")
    assert response.status_code == 200, path


def test_the_model_list_has_useful_columns_and_filters(admin_client: Client, fleet: Any) -> None:
    fleet.add("tiny-chat", min_replicas=0, max_replicas=2)
    text = text_of(admin_client.get("/admin/catalog/model/"))
    assert "tiny-chat alice opportunistic (default) on demand, up to 2" in text
    assert "By declared" in text and "By class" in text and "By owner" in text


def test_adding_a_model_from_yaml_goes_through_the_service(
    admin_client: Client, users: Any
) -> None:
    text = yaml.safe_dump(definition("from-admin", owner="bob"), sort_keys=False)
    response = admin_client.post("/admin/catalog/model/add/", add_form(text))
    assert response.status_code == 302, text_of(response)
    model = Model.objects.get(name="from-admin")
    assert model.owner.username == "bob"  # staff may add for someone else
    entry = AuditEntry.objects.get(action="add")
    assert (entry.actor_name, entry.door, entry.actor.username) == ("root", "admin", "root")


def test_a_refused_definition_is_shown_with_its_lines(admin_client: Client, users: Any) -> None:
    text = "name: bad\nsource: http://127.0.0.1:8000/x.gguf\nmin_replicas: -1\nprofiles: []\n"
    response = admin_client.post("/admin/catalog/model/add/", add_form(text))
    assert response.status_code == 200
    shown = text_of(response)
    assert "The definition was refused, nothing was changed:" in shown
    assert "line 3: min_replicas: must not be negative" in shown
    assert not Model.objects.filter(name="bad").exists()


def test_the_source_is_checked_unless_skipped(admin_client: Client, users: Any) -> None:
    text = yaml.safe_dump(definition("far", source="http://example.invalid/far.gguf"))
    response = admin_client.post("/admin/catalog/model/add/", add_form(text, skip=False))
    assert response.status_code == 200
    assert (
        "The control plane may not fetch http://example.invalid/far.gguf: example.invalid:80 is not in"
        in text_of(response)
    )


def test_the_change_form_offers_the_definition_as_yaml(admin_client: Client, fleet: Any) -> None:
    model = fleet.add("tiny-chat")
    html = admin_client.get(f"/admin/catalog/model/{model.pk}/change/").content.decode()
    assert "name: tiny-chat" in html and "min_replicas: 1" in html
    assert "open in the console" in html


def test_a_change_calls_one_service_per_kind_of_change(
    admin_client: Client, fleet: Any, users: Any
) -> None:
    model = fleet.add("tiny-chat")
    response = admin_client.post(
        f"/admin/catalog/model/{model.pk}/change/",
        change_form(
            model,
            min_replicas=2,
            max_replicas=3,
            owner="bob",
            **{"class": "critical"},
            profiles=[{"name": "cpu", "memory_gb": 3, "cores": 2, "gpus": 0, "gpu_memory_gb": 0}],
            adapters=[{"name": "tiny-sql", "source": "http://127.0.0.1:8000/s.gguf", "scale": 1}],
        ),
    )
    assert response.status_code == 302, text_of(response)
    model.refresh_from_db()
    assert (model.min_replicas, model.max_replicas, model.model_class) == (2, 3, "critical")
    assert model.owner.username == "bob"
    assert model.profiles[0]["memory_gb"] == 3 and model.profiles[0]["cores"] == 2
    assert [a["name"] for a in model.adapters] == ["tiny-sql"]
    entries = AuditEntry.objects.filter(door="admin")
    assert sorted(e.action for e in entries) == ["adapters", "class", "owner", "resources", "scale"]
    assert {e.actor_name for e in entries} == {"root"}


def test_a_refused_change_changes_nothing(admin_client: Client, fleet: Any) -> None:
    model = fleet.add("tiny-chat")
    response = admin_client.post(
        f"/admin/catalog/model/{model.pk}/change/",
        change_form(model, min_replicas=2, owner="nobody"),
    )
    assert response.status_code == 200
    assert "There is no user named 'nobody'; create the account first" in text_of(response)
    model.refresh_from_db()
    assert model.min_replicas == 1
    assert not AuditEntry.objects.filter(door="admin").exists()


def test_what_no_service_changes_is_refused_by_name(admin_client: Client, fleet: Any) -> None:
    model = fleet.add("tiny-chat")
    response = admin_client.post(
        f"/admin/catalog/model/{model.pk}/change/",
        change_form(model, source="http://127.0.0.1:8000/other.gguf"),
    )
    assert response.status_code == 200
    assert "source: cannot be changed in place" in text_of(response)
    assert "Remove the model and add it again with the new definition" in text_of(response)


def test_whole_catalog_checks_apply_in_the_admin_too(admin_client: Client, fleet: Any) -> None:
    fleet.add("other-chat")
    model = fleet.add("tiny-chat")
    response = admin_client.post(
        f"/admin/catalog/model/{model.pk}/change/",
        change_form(
            model, adapters=[{"name": "other-chat", "source": "http://127.0.0.1:8000/a.gguf"}]
        ),
    )
    assert response.status_code == 200
    assert "'other-chat' is already the name of model other-chat" in text_of(response)


def test_a_declared_model_is_refused_with_the_services_message(
    admin_client: Client, users: Any, server_yaml: Any
) -> None:
    from llmgw_site.startup import apply_config_on_start

    path = server_yaml({"models": [definition("decl-chat")]})
    apply_config_on_start("test")
    model = Model.objects.get(name="decl-chat")
    response = admin_client.post(
        f"/admin/catalog/model/{model.pk}/change/", change_form(model, min_replicas=4)
    )
    assert response.status_code == 200
    assert f"decl-chat is declared in {path}, which is read again on every start" in text_of(
        response
    )


def test_delete_goes_through_the_service(admin_client: Client, fleet: Any) -> None:
    """Audited as the admin user, and others' fallbacks to it dropped (a refusal of the service
    shows as an admin error: test_a_declared_model_is_refused_with_the_services_message)."""
    target = fleet.add("tiny-chat")
    leaning = fleet.add("leaning", fallbacks=["tiny-chat"])
    response = admin_client.post(f"/admin/catalog/model/{target.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not Model.objects.filter(name="tiny-chat").exists()
    leaning.refresh_from_db()
    assert leaning.fallbacks == []
    entry = AuditEntry.objects.get(action="remove")
    assert (entry.actor_name, entry.door) == ("root", "admin")
    dropped = AuditEntry.objects.get(action="fallback-dropped")
    assert (dropped.actor_name, dropped.door) == ("root", "admin")


def test_restart_and_remove_actions(admin_client: Client, fleet: Any) -> None:
    first, second = fleet.add("a-chat"), fleet.add("b-chat")
    response = admin_client.post(
        "/admin/catalog/model/",
        {"action": "restart_models", "_selected_action": [first.pk, second.pk]},
        follow=True,
    )
    assert "Rolling restart asked for: a-chat, b-chat." in text_of(response)
    assert AuditEntry.objects.filter(action="restart", door="admin").count() == 2
    actions = admin_client.get("/admin/catalog/model/").content.decode()
    assert 'value="delete_selected"' not in actions


def test_audit_entries_are_read_only(admin_client: Client, fleet: Any) -> None:
    fleet.add("tiny-chat")
    entry = AuditEntry.objects.get()
    assert admin_client.get("/admin/catalog/auditentry/add/").status_code == 403
    page = admin_client.get(f"/admin/catalog/auditentry/{entry.pk}/change/")
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert "min_replicas" in text_of(page)
    change = admin_client.post(f"/admin/catalog/auditentry/{entry.pk}/change/", {"note": "x"})
    assert change.status_code == 403
    delete = admin_client.post(f"/admin/catalog/auditentry/{entry.pk}/delete/", {"post": "yes"})
    assert delete.status_code == 403
    assert AuditEntry.objects.get().note == ""


def test_nodes_are_added_with_a_token_shown_once(admin_client: Client, users: Any) -> None:
    response = admin_client.post("/admin/fleet/node/add/", {"name": "node-b"}, follow=True)
    assert response.status_code == 200
    text = text_of(response)
    assert "Node node-b was added. Its token, shown only this once: llmgw-node-" in text
    assert Node.objects.filter(name="node-b").exists()
    again = admin_client.post("/admin/fleet/node/add/", {"name": "node-b"})
    assert "A node named node-b already exists; remove it first to issue a new token." in text_of(
        again
    )


def test_nodes_are_cordoned_and_uncordoned_by_actions(admin_client: Client, fleet: Any) -> None:
    node = fleet.node("node-a")
    response = admin_client.post(
        "/admin/fleet/node/", {"action": "cordon", "_selected_action": [node.pk]}, follow=True
    )
    assert "Cordoned: node-a." in text_of(response)
    assert Node.objects.get(pk=node.pk).cordoned
    admin_client.post("/admin/fleet/node/", {"action": "uncordon", "_selected_action": [node.pk]})
    assert not Node.objects.get(pk=node.pk).cordoned
    listing = text_of(admin_client.get("/admin/fleet/node/"))
    assert "node-a ready" in listing and "0 / 8" in listing


def test_replicas_are_read_only(admin_client: Client, fleet: Any) -> None:
    fleet.node("node-a")
    fleet.add("tiny-chat")
    reconcile_pass()
    assert admin_client.get("/admin/fleet/replica/add/").status_code == 403
    listing = text_of(admin_client.get("/admin/fleet/replica/"))
    assert "tiny-chat node-a cpu pending" in listing

"""The console's pages and actions: what each shows, what each changes, and the refusals it shows."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from catalog.models import AuditEntry, Model
from fleet.models import Node
from fleet.reconciler import reconcile_pass
from tests.console.pages import HTMX, row_of, text_of
from tests.factories import definition

pytestmark = [pytest.mark.django_db]


# -- logging in ---------------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("url", ["/", "/models/x/", "/nodes/", "/audit/", "/add/"])
def test_it_sends_strangers_to_log_in(url: str) -> None:
    response = Client().get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


def test_an_htmx_request_after_the_session_ended_reloads_to_the_login_page() -> None:
    response = Client().post("/models/tiny-chat/scale", {"min": 2}, headers=HTMX)
    assert response.status_code == 200
    assert response["HX-Redirect"] == "/login/?next=%2Fmodels%2Ftiny-chat%2F"


def test_it_logs_in_with_a_django_account(users: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    page = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert token
    response = client.post(
        "/login/",
        {"username": "alice", "password": "alice-password-1", "csrfmiddlewaretoken": token[1]},
    )
    assert response.status_code == 302
    assert client.get("/").status_code == 200


def test_a_wrong_password_is_told(users: Any) -> None:
    response = Client().post("/login/", {"username": "alice", "password": "nope"})
    assert "That username and password do not match an account." in text_of(response)


def test_posts_need_the_csrf_token(client_for: Any, running: Any, users: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(users["alice"])
    assert client.post("/models/tiny-chat/scale", {"min": 2}).status_code == 403
    assert Model.objects.get(name="tiny-chat").min_replicas == 1


def test_pages_carry_the_csrf_header_and_htmx_2_served_here(client_for: Any) -> None:
    html = client_for("alice").get("/").content.decode()
    assert 'hx-headers=\'{"X-CSRFToken": "' in html
    assert "/static/django_htmx/htmx-2" in html
    # Every script and stylesheet comes from our own static files, none from a CDN (the page's
    # random CSRF token can contain the letters "cdn", so look at the addresses only).
    addresses = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert addresses and all(a.startswith("/") or a.startswith("#") for a in addresses), addresses


# -- the models list ----------------------------------------------------------------


@pytest.mark.smoke
def test_the_list_shows_each_model_with_where_its_replicas_run(
    client_for: Any, running: Any
) -> None:
    response = client_for("carol").get("/")
    assert response.status_code == 200
    html = response.content.decode()
    row = row_of(html, "tiny-chat")
    assert "alice" in row and "standard" in row
    assert "1/1" in row and "node-a" in row and "state-ready" in row
    other = row_of(html, "other-chat")
    assert "not running" in other and "bob" in other
    assert 'class="registry-col"' in row  # the place kept for the registry badge and buttons


def test_the_list_filters_by_owner_class_state_and_name(client_for: Any, running: Any) -> None:
    client = client_for("carol")

    def names(query: str) -> list[str]:
        return re.findall(r'data-model="([^"]+)"', client.get(f"/?{query}").content.decode())

    assert names("owner=bob") == ["other-chat"]
    assert names("class=standard") == ["other-chat", "tiny-chat"]
    assert names("class=critical") == []
    assert names("state=ready") == ["tiny-chat"]
    assert names("state=not-running") == ["other-chat"]
    assert names("state=degraded") == []
    assert names("q=TINY") == ["tiny-chat"]
    assert "No model matches these filters." in text_of(client.get("/?q=nothing"))


def test_on_demand_models_filter_as_opportunistic(client_for: Any, fleet: Any) -> None:
    fleet.add("lazy", min_replicas=0, max_replicas=1)
    fleet.add("pinned", min_replicas=0, max_replicas=1, **{"class": "critical"})
    html = client_for("alice").get("/?class=opportunistic").content.decode()
    assert re.findall(r'data-model="([^"]+)"', html) == ["lazy"]


def test_a_model_with_fewer_ready_than_wanted_is_degraded(client_for: Any, running: Any) -> None:
    from catalog.services import Actor, model_scale

    alice = Model.objects.get(name="tiny-chat").owner
    model_scale(actor=Actor.for_user(alice, "api"), name="tiny-chat", min_replicas=3)
    html = client_for("alice").get("/?state=degraded").content.decode()
    assert re.findall(r'data-model="([^"]+)"', html) == ["tiny-chat"]
    assert "1/3" in html


def test_htmx_gets_only_the_table(client_for: Any, running: Any) -> None:
    response = client_for("alice").get("/?owner=alice", headers={"HX-Request": "true"})
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="models-table">')
    assert "<html" not in html
    assert "HX-Request" in response["Vary"]


def test_the_list_pages_through_models(client_for: Any, fleet: Any) -> None:
    for i in range(55):
        fleet.add(f"m-{i:02d}", min_replicas=0, max_replicas=0)
    client = client_for("alice")
    first = client.get("/").content.decode()
    assert len(re.findall(r'data-model="', first)) == 50
    assert "Page 1 of 2 · 55 in all" in text_of(client.get("/"))
    assert 'href="/?page=2"' in first and 'hx-get="/?page=2"' in first
    second = client.get("/?page=2").content.decode()
    assert re.findall(r'data-model="([^"]+)"', second) == [f"m-{i}" for i in range(50, 55)]
    filtered = client.get("/?q=m-&page=2").content.decode()
    assert 'href="/?q=m-&amp;page=1"' in filtered


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured.captured_queries)


def test_the_list_takes_the_same_number_of_queries_whatever_the_number_of_models(
    client_for: Any, fleet: Any
) -> None:
    fleet.node("node-a", memory_gb=1000, cores=1000)
    client = client_for("alice")
    fleet.add("m-000")
    reconcile_pass()
    fleet.beat("node-a")
    few = _queries(client, "/"), _queries(client, "/?state=ready&class=standard&q=m")
    for i in range(1, 40):
        fleet.add(f"m-{i:03d}", min_replicas=2)
    reconcile_pass()
    fleet.beat("node-a")
    many = _queries(client, "/"), _queries(client, "/?state=ready&class=standard&q=m")
    assert few == many


# -- one model ----------------------------------------------------------------------


@pytest.mark.smoke
def test_the_model_page_shows_definition_replicas_and_history(
    client_for: Any, running: Any
) -> None:
    response = client_for("carol").get("/models/tiny-chat/")
    assert response.status_code == 200
    html = response.content.decode()
    shown = re.search(r'<pre class="code" id="definition-yaml">(.*?)</pre>', html, re.S)
    assert shown
    assert (
        yaml.safe_load(shown[1].replace("&#x27;", "'"))
        == Model.objects.get(name="tiny-chat").definition()
    )
    text = text_of(response)
    assert "1 of 1 wanted" in text
    assert "node-a cpu ready yes" in text
    assert "tiny-sql" in text
    assert "alice via API add" in text  # the history


def test_an_unknown_model_is_404(client_for: Any, users: Any) -> None:
    assert client_for("alice").get("/models/nope/").status_code == 404


def test_someone_who_may_not_act_sees_no_action_buttons(client_for: Any, running: Any) -> None:
    html = client_for("carol").get("/models/tiny-chat/").content.decode()
    for form in ("scale-form", "resources-form", "class-form", "owner-form", "adapters-form"):
        assert f'id="{form}"' not in html
    assert 'id="restart-form"' not in html and 'id="remove-form"' not in html
    for who in ("alice", "staff"):
        html = client_for(who).get("/models/tiny-chat/").content.decode()
        assert 'id="scale-form"' in html and 'id="restart-form"' in html


def test_a_declared_model_says_where_to_change_it(
    client_for: Any, users: Any, server_yaml: Any
) -> None:
    from catalog.config import apply_config_on_start

    path = server_yaml({"models": [definition("decl-chat", owner="alice")]})
    apply_config_on_start("test")
    client = client_for("alice")
    html = client.get("/models/decl-chat/").content.decode()
    assert f"declared in {path}, which is read again on every start" in html
    assert 'id="scale-form"' not in html and 'id="restart-form"' in html
    response = client.post("/models/decl-chat/scale", {"min": 3}, headers=HTMX)
    assert response.status_code == 409
    assert f"decl-chat is declared in {path}" in text_of(response)


# -- changes, through the services --------------------------------------------------


def test_scale_with_htmx_answers_the_form_and_refreshes_the_rest(
    client_for: Any, running: Any
) -> None:
    response = client_for("alice").post(
        "/models/tiny-chat/scale", {"min": 2, "max": 3, "idle_timeout": ""}, headers=HTMX
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith('<form id="scale-form"')
    assert "Scale in force: 2 replicas (max 3)." in html
    for part in ("model-summary", "model-details", "model-replicas", "model-history"):
        assert f'id="{part}" class' in html and 'hx-swap-oob="true"' in html
    model = Model.objects.get(name="tiny-chat")
    assert (model.min_replicas, model.max_replicas) == (2, 3)
    entry = AuditEntry.objects.filter(action="scale").get()
    assert (entry.actor_name, entry.door) == ("alice", "console")
    assert entry.changes == {"min_replicas": [1, 2], "max_replicas": [None, 3]}


def test_scale_without_javascript_redirects_and_says_what_is_in_force(
    client_for: Any, running: Any
) -> None:
    client = client_for("alice")
    response = client.post("/models/tiny-chat/scale", {"min": 0, "max": 2, "idle_timeout": "5m"})
    assert response.status_code == 302
    assert response["Location"] == "/models/tiny-chat/"
    page = text_of(client.get("/models/tiny-chat/"))
    assert "Scale in force: on demand, up to 2 (idle timeout 5m)." in page


def test_a_refused_scale_shows_the_message_and_the_problem_at_its_field(
    client_for: Any, running: Any
) -> None:
    response = client_for("alice").post(
        "/models/tiny-chat/scale", {"min": 3, "max": 1}, headers=HTMX
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert "The scale was refused, nothing was changed:" in text_of(response)
    max_field = html[html.index('id="scale-max"') :]
    assert "max (1) is below min (3); max is a ceiling" in max_field[: max_field.index("</div>")]
    assert Model.objects.get(name="tiny-chat").min_replicas == 1


def test_a_refusal_without_javascript_renders_the_page_with_it(
    client_for: Any, running: Any
) -> None:
    response = client_for("alice").post("/models/tiny-chat/scale", {"min": 1001})
    assert response.status_code == 400
    text = text_of(response)
    assert (
        "The scale was refused, nothing was changed: min: must be a whole number from 0 to 1000."
        in text
    )
    assert "<html" in response.content.decode()


def test_text_where_a_number_belongs_is_told_in_our_words(client_for: Any, running: Any) -> None:
    response = client_for("alice").post(
        "/models/tiny-chat/scale", {"min": "two", "idle_timeout": "soon"}, headers=HTMX
    )
    assert response.status_code == 400
    text = text_of(response)
    assert "The replica count is a whole number, like 2." in text
    assert "'soon' is not a duration" in text


@pytest.mark.parametrize(
    ("url", "data"),
    [
        ("scale", {"min": 2}),
        ("resources", {"memory_gb": 2}),
        ("class", {"class": "critical"}),
        ("owner", {"owner": "carol"}),
        ("adapters", {"remove": ["tiny-sql"]}),
        ("restart", {}),
        ("remove", {}),
    ],
)
def test_someone_who_may_not_act_gets_403_with_the_services_message(
    client_for: Any, running: Any, url: str, data: dict[str, Any]
) -> None:
    before = Model.objects.get(name="tiny-chat").definition()
    for headers in (HTMX, {}):
        response = client_for("carol").post(f"/models/tiny-chat/{url}", data, headers=headers)
        assert response.status_code == 403
        assert (
            "tiny-chat belongs to alice; only they or a staff user may change it. Ask them, or "
            "ask staff to hand it over with `llmgw ctl model owner tiny-chat USER`."
        ) in text_of(response).replace("&#x60;", "`")
    assert Model.objects.get(name="tiny-chat").definition() == before
    assert not AuditEntry.objects.filter(door="console").exists()


def test_staff_may_act_on_any_model(client_for: Any, running: Any) -> None:
    response = client_for("staff").post(
        "/models/tiny-chat/class", {"class": "critical"}, headers=HTMX
    )
    assert response.status_code == 200
    assert "Class in force: critical." in text_of(response)
    entry = AuditEntry.objects.get(action="class")
    assert (entry.actor_name, entry.door) == ("staff", "console")


def test_resources_for_one_profile_and_a_refusal_naming_the_profiles(
    client_for: Any, running: Any
) -> None:
    client = client_for("alice")
    response = client.post(
        "/models/tiny-chat/resources",
        {"memory_gb": "2.5", "cores": "2", "profile": "cpu"},
        headers=HTMX,
    )
    assert response.status_code == 200
    assert "Each replica now reserves cpu: 2.5 GB, 2 cores." in text_of(response)
    response = client.post(
        "/models/tiny-chat/resources", {"memory_gb": "2", "profile": "gpu"}, headers=HTMX
    )
    assert response.status_code == 400
    assert "tiny-chat has no profile 'gpu'; it has cpu" in text_of(response)
    response = client.post("/models/tiny-chat/resources", {"memory_gb": "99999"}, headers=HTMX)
    assert "memory: must be from 0 to 16384 GB" in text_of(response)


def test_class_default_and_an_unknown_class(client_for: Any, running: Any) -> None:
    client = client_for("alice")
    response = client.post("/models/tiny-chat/class", {"class": "default"}, headers=HTMX)
    assert response.status_code == 200
    assert "Class in force: standard (the default)." in text_of(response)
    response = client.post("/models/tiny-chat/class", {"class": "vip"}, headers=HTMX)
    assert response.status_code == 400
    assert "'vip' is not a class: use critical, standard, opportunistic or default" in text_of(
        response
    )


def test_handing_a_model_over_and_an_unknown_user(client_for: Any, running: Any) -> None:
    client = client_for("alice")
    response = client.post("/models/tiny-chat/owner", {"owner": "nobody"}, headers=HTMX)
    assert response.status_code == 400
    assert (
        "There is no user named 'nobody'; create the account first (console or admin)."
        in text_of(response)
    )
    response = client.post("/models/tiny-chat/owner", {"owner": "bob"}, headers=HTMX)
    assert response.status_code == 200
    assert "tiny-chat now belongs to bob." in text_of(response)
    # alice no longer owns it: the next change is hers to ask for.
    assert client.post("/models/tiny-chat/scale", {"min": 2}, headers=HTMX).status_code == 403


def test_adapters_added_and_removed_with_the_apis_checks(client_for: Any, running: Any) -> None:
    client = client_for("alice")
    response = client.post(
        "/models/tiny-chat/adapters",
        {
            "remove": ["tiny-sql"],
            "name": "tiny-code",
            "source": "http://127.0.0.1:8000/mirror/a/b/c/code.gguf",
            "scale": "0.5",
            "skip_source_check": "on",
        },
        headers=HTMX,
    )
    assert response.status_code == 200, text_of(response)
    assert "Adapters in force: tiny-code." in text_of(response)
    assert Model.objects.get(name="tiny-chat").adapters == [
        {
            "name": "tiny-code",
            "source": "http://127.0.0.1:8000/mirror/a/b/c/code.gguf",
            "scale": 0.5,
        }
    ]
    response = client.post(
        "/models/tiny-chat/adapters",
        {"name": "other-chat", "source": "http://127.0.0.1:8000/x.gguf", "skip_source_check": "on"},
        headers=HTMX,
    )
    assert response.status_code == 400
    assert "'other-chat' is already the name of model other-chat" in text_of(response)
    response = client.post(
        "/models/tiny-chat/adapters", {"name": "x", "source": "ftp://nope"}, headers=HTMX
    )
    assert response.status_code == 400
    assert "'ftp://nope' is not an http(s) URL" in text_of(response)
    response = client.post("/models/tiny-chat/adapters", {"remove": ["ghost"]}, headers=HTMX)
    assert "tiny-chat has no adapter 'ghost'; it has tiny-code" in text_of(response)
    response = client.post("/models/tiny-chat/adapters", {}, headers=HTMX)
    assert "Nothing to change: name an adapter to add, or tick one to remove." in text_of(response)


def test_an_adapter_source_is_checked_unless_skipped(client_for: Any, running: Any) -> None:
    response = client_for("alice").post(
        "/models/tiny-chat/adapters",
        {"name": "far", "source": "http://example.invalid/far.gguf"},
        headers=HTMX,
    )
    assert response.status_code == 400
    assert (
        "The control plane may not fetch http://example.invalid/far.gguf: example.invalid:80 is not in"
        in text_of(response)
    )


def test_a_rolling_restart_asks_first_then_bumps_the_generation(
    client_for: Any, running: Any
) -> None:
    client = client_for("alice")
    html = client.get("/models/tiny-chat/").content.decode()
    restart = html[html.index('id="restart-form"') :]
    assert restart.index("<details>") < restart.index('type="submit"')  # a confirmation step
    response = client.post("/models/tiny-chat/restart", headers=HTMX)
    assert response.status_code == 200
    assert "Rolling restart of tiny-chat asked for (generation 1)" in text_of(response)
    assert Model.objects.get(name="tiny-chat").generation == 1
    entry = AuditEntry.objects.get(action="restart")
    assert (entry.actor_name, entry.door) == ("alice", "console")


def test_remove_and_its_refusal(client_for: Any, running: Any, fleet: Any) -> None:
    fleet.add("leaning", fallbacks=["tiny-chat"], min_replicas=0, max_replicas=0)
    client = client_for("alice")
    response = client.post("/models/tiny-chat/remove", headers=HTMX)
    assert response.status_code == 409
    assert "tiny-chat cannot be removed: leaning falls back to it." in text_of(response)
    response = client.post("/models/leaning/remove", headers=HTMX)
    assert response["HX-Redirect"] == "/"
    assert not Model.objects.filter(name="leaning").exists()
    response = client.post("/models/tiny-chat/remove")
    assert response.status_code == 302
    assert "tiny-chat was removed from the catalog" in text_of(client.get("/"))
    assert AuditEntry.objects.filter(action="remove", door="console").count() == 2


def test_changes_need_post(client_for: Any, running: Any) -> None:
    assert client_for("alice").get("/models/tiny-chat/scale").status_code == 405


# -- adding a model -----------------------------------------------------------------


def test_the_add_page_offers_an_example_and_the_skip_checkbox(client_for: Any, users: Any) -> None:
    html = client_for("alice").get("/add/").content.decode()
    assert "name: my-model" in html
    assert 'name="skip_source_check"' in html


def test_adding_from_yaml_makes_you_the_owner(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(definition("pasted"), sort_keys=False)
    response = client_for("bob").post("/add/model", {"definition": text, "skip_source_check": "on"})
    assert response.status_code == 302
    assert response["Location"] == "/models/pasted/"
    model = Model.objects.get(name="pasted")
    assert model.owner.username == "bob"
    entry = AuditEntry.objects.get(action="add")
    assert (entry.actor_name, entry.door) == ("bob", "console")
    htmx = client_for("bob").post(
        "/add/model",
        {"definition": text.replace("pasted", "pasted-2"), "skip_source_check": "on"},
        headers=HTMX,
    )
    assert htmx["HX-Redirect"] == "/models/pasted-2/"


def test_problems_are_shown_next_to_their_lines(client_for: Any, users: Any) -> None:
    text = (
        "name: bad-one\n"
        "source: http://127.0.0.1:8000/mirror/a/b/c/x.gguf\n"
        "min_replicas: -1\n"
        "profiles:\n"
        "  - {name: cpu, memory_gb: 1, cores: 1}\n"
        "colour: blue\n"
    )
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}, headers=HTMX
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert html.lstrip().startswith('<form id="add-form"')
    assert "The definition was refused, nothing was changed:" in text_of(response)
    line3 = html[html.index('id="line-3"') : html.index('id="line-4"')]
    assert "min_replicas: -1" in line3 and "must not be negative" in line3
    line6 = html[html.index('id="line-6"') :]
    assert "unknown field; known fields:" in line6[: line6.index("</li>")]
    assert 'id="line-5" data-line="5">' in html  # a line without a problem is not marked
    assert not Model.objects.filter(name="bad-one").exists()


def test_whole_catalog_problems_find_their_line_too(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(definition("lonely", fallbacks=["ghost"]), sort_keys=False)
    number = text.splitlines().index("- ghost") + 1
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}, headers=HTMX
    )
    assert response.status_code == 400
    html = response.content.decode()
    line = html[html.index(f'id="line-{number}"') :]
    assert "there is no model named 'ghost' to fall back to; add it first" in line[
        : line.index("</li>")
    ].replace("&#x27;", "'")


def test_yaml_that_cannot_be_read_points_at_its_line(client_for: Any, users: Any) -> None:
    text = "name: x\nsource: [unclosed\nprofiles: []\n"
    response = client_for("alice").post("/add/model", {"definition": text})
    assert response.status_code == 400
    assert "The definition is not valid YAML: the YAML could not be read on line" in text_of(
        response
    )
    assert 'class="has-problem"' in response.content.decode()


def test_the_source_is_checked_unless_skipped(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(
        definition("far", source="http://example.invalid/far.gguf"), sort_keys=False
    )
    response = client_for("alice").post("/add/model", {"definition": text})
    assert response.status_code == 400
    assert (
        "The control plane may not fetch http://example.invalid/far.gguf: example.invalid:80 is not in"
        in text_of(response)
    )
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}
    )
    assert response.status_code == 302


def test_a_taken_name_is_a_conflict(client_for: Any, running: Any) -> None:
    text = yaml.safe_dump(definition("tiny-chat"), sort_keys=False)
    response = client_for("bob").post("/add/model", {"definition": text, "skip_source_check": "on"})
    assert response.status_code == 409
    assert "A model named tiny-chat already exists (added at runtime, owned by alice)." in text_of(
        response
    )


def test_only_staff_may_add_a_model_for_someone_else(client_for: Any, users: Any) -> None:
    text = yaml.safe_dump(definition("gift", owner="bob"), sort_keys=False)
    response = client_for("alice").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}
    )
    assert response.status_code == 403
    assert "only staff may add one owned by bob" in text_of(response)
    response = client_for("staff").post(
        "/add/model", {"definition": text, "skip_source_check": "on"}
    )
    assert response.status_code == 302
    assert Model.objects.get(name="gift").owner.username == "bob"


# -- nodes --------------------------------------------------------------------------


@pytest.mark.smoke
def test_the_nodes_page_shows_capacity_reserved_free_and_replicas(
    client_for: Any, running: Any
) -> None:
    response = client_for("carol").get("/nodes/")
    assert response.status_code == 200
    html = response.content.decode()
    text = text_of(response)
    assert "node-a" in text and "ready" in text
    assert "1 / 8 GB reserved · 7 free" in text
    assert "1 / 4 reserved · 3 free" in text
    assert 'style="width: 12%"' in html and 'style="width: 25%"' in html
    assert "tiny-chat" in text and "last heartbeat 0 minutes ago" in text
    assert "Cordon" not in text  # carol is not staff


def test_staff_cordon_and_uncordon_a_node(client_for: Any, running: Any) -> None:
    client = client_for("staff")
    assert "Cordon" in text_of(client.get("/nodes/"))
    response = client.post("/nodes/node-a/cordon", headers=HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith('<article class="card node" id="node-node-a"')
    assert "node-a is cordoned: it keeps its replicas, and nothing new is placed there." in html
    assert "Uncordon" in html
    assert Node.objects.get(name="node-a").cordoned
    response = client.post("/nodes/node-a/uncordon")
    assert response.status_code == 302
    assert not Node.objects.get(name="node-a").cordoned


def test_someone_not_staff_may_not_cordon(client_for: Any, running: Any) -> None:
    for headers in (HTMX, {}):
        response = client_for("alice").post("/nodes/node-a/cordon", headers=headers)
        assert response.status_code == 403
        assert "Only staff may cordon nodes; ask an administrator." in text_of(response)
    assert not Node.objects.get(name="node-a").cordoned


def test_an_unknown_node_is_told(client_for: Any, running: Any) -> None:
    response = client_for("staff").post("/nodes/nope/cordon")
    assert response.status_code == 404
    assert "There is no node named 'nope' (nodes: node-a)." in text_of(response)


# -- audit --------------------------------------------------------------------------


@pytest.mark.smoke
def test_the_audit_page_lists_changes_newest_first(client_for: Any, running: Any) -> None:
    client_for("alice").post("/models/tiny-chat/scale", {"min": 2})
    response = client_for("carol").get("/audit/")
    text = text_of(response)
    assert text.index("alice via console") < text.index("alice via API")
    assert "min_replicas : 1 → 2" in text


def test_the_audit_page_filters_and_pages(client_for: Any, running: Any) -> None:
    client = client_for("alice")
    for count in range(2, 55):
        client.post("/models/tiny-chat/scale", {"min": count % 3 + 1})
    html = client.get("/audit/?model=tiny-chat&action=scale").content.decode()
    assert html.count("<tr>") == 1 + 50  # the header row and one page
    assert "Page 1 of 2" in text_of(client.get("/audit/?model=tiny-chat&action=scale"))
    assert 'href="/audit/?model=tiny-chat&amp;action=scale&amp;page=2"' in html
    only_bob = client.get("/audit/?actor=bob").content.decode()
    assert "other-chat" in only_bob and "tiny-chat</a>" not in only_bob
    partial = client.get("/audit/?action=add", headers={"HX-Request": "true"}).content.decode()
    assert partial.lstrip().startswith('<div id="audit-table">')


def test_the_model_and_nodes_pages_show_what_the_engines_report(
    client_for: Any, running: Any
) -> None:
    from django.utils import timezone

    from fleet.models import Replica

    Replica.objects.filter(model_name="tiny-chat").update(
        slots=4,
        engine_metrics={
            "predicted_tokens": 900.0,
            "prompt_tokens": 150.0,
            "prompt_tokens_cached": 450.0,
            "requests_processing": 2.0,
            "requests_deferred": 0.0,
            "tokens_per_second": 37.5,
        },
        engine_metrics_at=timezone.now(),
    )
    line = "37.5 tokens/s · 2 of 4 slots busy · prompt cache 75% of prompt tokens"

    assert line in text_of(client_for("carol").get("/models/tiny-chat/"))
    assert f"Engines: {line}" in text_of(client_for("carol").get("/nodes/"))

    # Numbers no agent sent lately are not shown as if they were current.
    Replica.objects.update(engine_metrics_at=timezone.now() - timezone.timedelta(minutes=5))
    assert "tokens/s" not in text_of(client_for("carol").get("/models/tiny-chat/"))
    assert "Engines:" not in text_of(client_for("carol").get("/nodes/"))

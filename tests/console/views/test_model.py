"""A model's page and its forms: what it shows, what each form changes through the services,
and the refusals it shows."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from catalog.models import AuditEntry, Model
from tests.console.pages import HTMX, text_of
from tests.factories import definition

pytestmark = [pytest.mark.django_db]


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


def test_the_404_page_says_why_without_debug(client_for: Any, running: Any, settings: Any) -> None:
    settings.DEBUG = False
    response = client_for("alice").get("/models/tiny-caht/")
    assert response.status_code == 404
    text = response.content.decode()
    assert "did you mean tiny-chat?" in text and "Log out alice" in text
    response = client_for("alice").get("/no/such/page/")
    assert response.status_code == 404
    assert "Nothing is here at /no/such/page/." in response.content.decode()


def test_an_unknown_model_is_refused_in_the_services_words(running: Any) -> None:
    from django.http import Http404

    from catalog.services import get_model as service_get_model
    from console.views.pages import get_model
    from core.refusals import Refused

    with pytest.raises(Http404) as console_refusal:
        get_model("tiny-caht")
    with pytest.raises(Refused) as service_refusal:
        service_get_model("tiny-caht")
    assert str(console_refusal.value) == service_refusal.value.message
    assert "did you mean tiny-chat?" in str(console_refusal.value)


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
    from llmgw_site.startup import apply_config_on_start

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
    response = client_for("carol").post("/models/tiny-chat/remove", headers=HTMX)
    assert response.status_code == 403
    assert "tiny-chat belongs to alice; only they or a staff user may change it." in text_of(
        response
    )
    assert Model.objects.filter(name="tiny-chat").exists()
    client = client_for("alice")
    # Another model's fallback does not keep a model from its owner: it is dropped, audited.
    response = client.post("/models/tiny-chat/remove")
    assert response.status_code == 302
    assert "tiny-chat was removed from the catalog" in text_of(client.get("/"))
    assert Model.objects.get(name="leaning").fallbacks == []
    assert AuditEntry.objects.filter(action="remove", door="console").count() == 1
    dropped = AuditEntry.objects.get(action="fallback-dropped")
    assert (dropped.door, dropped.actor_name) == ("console", "alice")


def test_changes_need_post(client_for: Any, running: Any) -> None:
    assert client_for("alice").get("/models/tiny-chat/scale").status_code == 405


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


def test_autoscale_on_with_a_refusal_first_then_off(client_for: Any, running: Any) -> None:
    client = client_for("alice")
    response = client.post("/models/tiny-chat/autoscale", {"wait": "2s"}, headers=HTMX)
    assert response.status_code == 400
    assert "there is no room to scale: set a max above 1 first" in text_of(response)
    assert Model.objects.get(name="tiny-chat").autoscale is None
    client.post("/models/tiny-chat/scale", {"min": 1, "max": 3, "idle_timeout": ""}, headers=HTMX)

    response = client.post(
        "/models/tiny-chat/autoscale", {"wait": "2s", "down_after": "5m"}, headers=HTMX
    )
    assert response.status_code == 200
    assert (
        "Autoscaling on: between 1 and 3 replicas, keeping the queue wait under 2s "
        "(up after 30s, down after 5m)." in text_of(response)
    )
    assert Model.objects.get(name="tiny-chat").autoscale == {
        "wait": 2,
        "up_after": 30,
        "down_after": 300,
    }
    page = text_of(client.get("/models/tiny-chat/"))
    assert "autoscaled: no decision yet" in page
    response = client.post("/models/tiny-chat/autoscale", {"up_after": "1m"}, headers=HTMX)
    assert response.status_code == 400 and "Give the queue wait" in text_of(response)
    response = client.post("/models/tiny-chat/autoscale", {}, headers=HTMX)
    assert "Autoscaling off: tiny-chat runs its min (1)." in text_of(response)
    assert Model.objects.get(name="tiny-chat").autoscale is None
    entry = AuditEntry.objects.filter(action="autoscale").first()
    assert (entry.actor_name, entry.door) == ("alice", "console")

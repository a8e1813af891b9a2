"""The console's side of a canary update: the Update dialog's canary fields, the canary on the
model page with both revisions' figures, and Promote and Abort (registry.canary)."""

from __future__ import annotations

from typing import Any

import pytest

from catalog.models import AuditEntry, Model
from registry.models import Rollout
from tests.console.pages import HTMX, text_of
from tests.console.views.test_model_registry import from_the_registry
from tests.factories import canary_record

pytestmark = [pytest.mark.django_db]

WATCHING = canary_record()


def test_the_update_dialog_offers_a_canary(client_for: Any, running: Any) -> None:
    from_the_registry(size=400_000, new_size=500_000)
    html = client_for("alice").get("/models/tiny-chat/").content.decode()
    dialog = html[html.index('action="/models/tiny-chat/update"') :]
    dialog = dialog[: dialog.index("</form>")]
    for field in ("canary", "for", "max_error_rate", "max_latency_ratio"):
        assert f'name="{field}"' in dialog


def test_an_update_with_a_canary_percentage_starts_a_canary(client_for: Any, running: Any) -> None:
    from_the_registry(size=400_000, new_size=500_000)
    response = client_for("alice").post(
        "/models/tiny-chat/update",
        {"canary": "15", "for": "30m", "max_error_rate": "0.02", "max_latency_ratio": ""},
        headers=HTMX,
    )
    assert response.status_code == 200, text_of(response)
    assert (
        "Update of tiny-chat started (a1b2c3d → e4f5a6b): the new files are fetched and checked, "
        "then a canary replica gets 15% of the requests for 30m before the others follow."
    ) in text_of(response)
    canary = Model.objects.get(name="tiny-chat").canary
    assert (canary["state"], canary["percent"], canary["window_seconds"]) == ("waiting", 15, 1800)
    assert (canary["max_error_rate"], canary["max_latency_ratio"]) == (0.02, 2.0)
    assert (
        "Waiting for its replica to be ready; it then gets 15% of the requests for 30m"
        in text_of(response)
    )
    entry = AuditEntry.objects.get(action="canary")
    assert (entry.actor_name, entry.door) == ("alice", "console")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"canary": "0"}, "--canary must be a whole percentage from 1 to 99 (got 0)"),
        ({"canary": "ten"}, "--canary must be a whole percentage from 1 to 99 (got 'ten')"),
        ({"canary": "10", "for": "1y"}, "--for: '1y' is not a duration"),
        ({"canary": "10", "max_error_rate": "lots"}, "--max-error-rate must be a fraction"),
        (
            {"canary": "10", "max_latency_ratio": "inf"},
            "--max-latency-ratio must be a number from 1 to 100 (got inf)",
        ),
        ({"for": "10m"}, "Canary time and limits only mean something for a canary update"),
    ],
)
def test_bad_canary_fields_are_refused_and_nothing_starts(
    client_for: Any, running: Any, fields: dict[str, str], says: str
) -> None:
    from_the_registry(size=400_000, new_size=500_000)
    response = client_for("alice").post("/models/tiny-chat/update", fields, headers=HTMX)
    assert response.status_code == 400
    assert says in text_of(response)
    assert not Rollout.objects.exists() and Model.objects.get(name="tiny-chat").canary is None


def test_the_model_page_shows_the_canary_and_both_revisions_figures(
    client_for: Any, running: Any
) -> None:
    Model.objects.filter(name="tiny-chat").update(canary=WATCHING)
    page = text_of(client_for("bob").get("/models/tiny-chat/"))
    assert "Canary watching" in page
    assert (
        "20% of the requests to e4f5a6b for 10m, from 00:10:00 to 00:20:00 UTC; 4 checks." in page
    )
    assert "old a1b2c3d 80 0 (0%) 0.200 s" in page
    assert "new e4f5a6b 20 1 (5%) 0.250 s" in page
    assert "Last check: healthy so far" in page
    assert "Promote…" not in page  # bob is neither the owner nor staff
    assert "Promote…" in text_of(client_for("alice").get("/models/tiny-chat/"))


def test_promote_and_abort_from_the_model_page(client_for: Any, running: Any) -> None:
    Model.objects.filter(name="tiny-chat").update(canary=WATCHING)
    refused = client_for("bob").post("/models/tiny-chat/canary/abort", headers=HTMX)
    assert refused.status_code == 403
    assert "tiny-chat belongs to alice" in text_of(refused)
    assert Model.objects.get(name="tiny-chat").canary["state"] == "watching"

    response = client_for("staff").post("/models/tiny-chat/canary/abort", headers=HTMX)
    assert response.status_code == 200
    text = text_of(response)
    assert "Canary of tiny-chat aborted: back to the old revision, whose replicas serve on." in text
    assert "Aborted by staff: aborted by staff" in text
    entry = AuditEntry.objects.get(action="canary-rollback")
    assert (entry.actor_name, entry.door) == ("staff", "console")

    Model.objects.filter(name="tiny-chat").update(canary=WATCHING)
    response = client_for("alice").post("/models/tiny-chat/canary/promote")
    assert response.status_code == 302  # without htmx: back to the page
    assert Model.objects.get(name="tiny-chat").canary["state"] == "promoted"
    again = client_for("alice").post("/models/tiny-chat/canary/promote", headers=HTMX)
    assert again.status_code == 409
    assert "tiny-chat has no canary under way (the last one was promoted)" in text_of(again)

"""The console's registry part: serving from the registry and a fetch's progress, the update
badge, a model's revisions, "Check for updates now", and Update and Roll back with their progress.

Tests that need a registry run olah on local git-lfs repositories (tests/support/registry.py),
started once for the module; each test uses a repository of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from catalog.models import AuditEntry, Model
from llmgw.tinygguf import write_tiny_model
from registry import fetches
from registry.models import Fetch, MirrorFile, Rollout
from registry.rollouts import advance_rollouts
from tests.console.pages import HTMX, row_of, text_of
from tests.support.registry import LocalRegistry, available
from tests.support.tiny_hf import make_tiny_llama

pytestmark = [pytest.mark.django_db]

needs_registry = pytest.mark.skipif(available() is not None, reason=str(available()))

# Commits as the issue writes them: a1b2c3d → e4f5a6b; c0ffee0 is what Roll back returns to.
OLD, NEW, OLDER = "a1b2c3d" + "0" * 33, "e4f5a6b" + "1" * 33, "c0ffee0" + "2" * 33


def from_the_registry(
    name: str = "tiny-chat",
    *,
    size: int = 4_000_000_000,
    new_size: int = 4_100_000_000,
    update: bool = True,
    previous: bool = False,
) -> Model:
    """Make a model look served from the registry: an origin, maybe an update and a previous revision."""
    model = Model.objects.get(name=name)
    weights = {"path": f"{name}-q4.gguf", "size": size, "sha256": "0" * 64}
    model.origin = {"repo": f"acme/{name}", "branch": "main", "commit": OLD, "files": [weights]}
    model.update_checked_at = timezone.now()
    if update:
        model.update_available = {
            "commit": NEW,
            "files": [{**weights, "size": new_size, "sha256": "1" * 64}],
            "bytes": new_size,
            "checked_at": timezone.now().isoformat(),
        }
    if previous:
        model.previous = {
            "source": "http://127.0.0.1:8000/mirror/acme/tiny-chat/c0ffee0/tiny-chat-q4.gguf",
            "sha256": "2" * 64,
            "origin": {**model.origin, "commit": OLDER, "files": [{**weights, "sha256": "2" * 64}]},
        }
    model.save()
    return model


def rollout(name: str = "tiny-chat", **fields: Any) -> Rollout:
    model = Model.objects.get(name=name)
    values: dict[str, Any] = {
        "kind": "update",
        "state": Rollout.ROLLING,
        "from_commit": OLD,
        "to_commit": NEW,
        "actor_name": "alice",
        "door": "console",
        **fields,
    }
    return Rollout.objects.create(model=model, **values)


# -- the badge, Update and Roll back --------------------------------------------------


def test_the_models_page_says_the_update_as_the_issue_words_it(
    client_for: Any, running: Any
) -> None:
    from_the_registry()
    row = row_of(client_for("alice").get("/").content.decode(), "tiny-chat")
    assert "update available: a1b2c3d → e4f5a6b, 1 file, 4.1 GB" in row
    assert 'action="/models/tiny-chat/update"' in row
    assert "rollback" not in row  # nothing to go back to yet
    # Update asks first: the submit button is inside a confirmation that opens.
    update = row[row.index('action="/models/tiny-chat/update"') :]
    assert update.index("<summary") < update.index("Yes, update to e4f5a6b")
    carol = row_of(client_for("carol").get("/").content.decode(), "tiny-chat")
    assert "update available: a1b2c3d → e4f5a6b" in carol
    assert 'action="/models/tiny-chat/update"' not in carol


def test_update_starts_through_the_service_and_answers_with_its_progress(
    client_for: Any, running: Any
) -> None:
    from_the_registry(size=400_000, new_size=500_000)
    client = client_for("alice")

    carol = client_for("carol").post("/models/tiny-chat/update", {"in": "list"}, headers=HTMX)
    assert carol.status_code == 403
    assert "tiny-chat belongs to alice; only they or a staff user may change it." in text_of(carol)

    response = client.post("/models/tiny-chat/update", {"in": "list"}, headers=HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith('<tr id="model-tiny-chat"')  # the whole row of the list
    text = text_of(response)
    assert (
        "Update of tiny-chat started (a1b2c3d → e4f5a6b): the new files are fetched and "
        "checked, then replicas are replaced one at a time." in text
    )
    assert "update: fetching" in text and "0 of 500 kB fetched" in text
    assert 'hx-get="/models/tiny-chat/registry?in=list" hx-trigger="every 2s"' in html
    assert 'action="/models/tiny-chat/update"' not in html  # not while one runs
    entry = AuditEntry.objects.get(action="update")
    assert (entry.actor_name, entry.door) == ("alice", "console")

    again = client.post("/models/tiny-chat/update", headers=HTMX)
    assert again.status_code == 409
    assert "An update of tiny-chat is already under way (asked by alice, fetching)" in text_of(
        again
    )


def test_roll_back_asks_first_and_works_without_javascript(client_for: Any, running: Any) -> None:
    from_the_registry(update=False, previous=True)
    client = client_for("alice")
    html = client.get("/models/tiny-chat/").content.decode()
    confirm = html[html.index('action="/models/tiny-chat/rollback"') :]
    assert confirm.index("Roll back…</summary>") < confirm.index("Yes, roll back to c0ffee0")
    response = client.post("/models/tiny-chat/rollback")
    assert response.status_code == 302
    page = text_of(client.get("/models/tiny-chat/"))
    assert "Rollback of tiny-chat started (a1b2c3d → c0ffee0)" in page
    assert "rollback: rolling" in page
    assert AuditEntry.objects.filter(action="rollback", door="console").exists()


def test_update_with_nothing_newer_is_told(client_for: Any, running: Any) -> None:
    response = client_for("alice").post("/models/tiny-chat/update", headers=HTMX)
    assert response.status_code == 400
    assert "tiny-chat was not served from the registry, so there is nothing to update it from." in (
        text_of(response)
    )


def test_a_fetching_rollout_shows_its_bytes_and_who_asked(client_for: Any, running: Any) -> None:
    from_the_registry(size=400_000, new_size=500_000)
    client = client_for("alice")
    client.post("/models/tiny-chat/update", headers=HTMX)
    Fetch.objects.update(state=Fetch.RUNNING, bytes_done=200_000)

    page = client.get("/models/tiny-chat/")
    html, text = page.content.decode(), text_of(page)
    assert 'aria-label="new files fetched"' in html and 'value="40"' in html
    assert "200 of 500 kB fetched" in text
    assert "a1b2c3d → e4f5a6b, asked by alice" in text
    assert "fetching the new files into the mirror" not in text  # the bar says it
    row = row_of(client.get("/").content.decode(), "tiny-chat")
    assert "200 of 500 kB fetched" in row


def test_the_model_pages_poll_refreshes_the_replicas_summary_and_history(
    client_for: Any, running: Any
) -> None:
    from_the_registry(previous=True)
    rollout(replaced=1, total=2, step="replaced 1 of 2; a new replica is starting")
    client = client_for("alice")
    html = client.get("/models/tiny-chat/").content.decode()
    assert 'hx-get="/models/tiny-chat/registry" hx-trigger="every 2s"' in html

    polled = client.get("/models/tiny-chat/registry", headers=HTMX)
    html = polled.content.decode()
    assert html.lstrip().startswith('<div class="registry full" id="registry-tiny-chat"')
    assert 'value="50"' in html and "1 of 2 replicas" in text_of(polled)
    assert "replaced 1 of 2; a new replica is starting" in text_of(polled)
    for part in ("model-summary", "model-replicas", "model-history"):
        assert f'<section id="{part}" class="' in html
    assert html.count('hx-swap-oob="true"') == 3
    # During an update, Roll back stays offered: it stops the update.
    assert "the update under way stops" in text_of(polled)

    listed = client.get("/models/tiny-chat/registry?in=list", headers=HTMX).content.decode()
    assert listed.lstrip().startswith('<tr id="model-tiny-chat"')
    assert 'hx-target="closest tr"' in listed and "node-a" in listed
    assert "replaced 1 of 2; a new replica is starting" in listed
    assert "hx-swap-oob" not in listed
    # Without htmx the address is the model's page.
    assert client.get("/models/tiny-chat/registry").status_code == 302


def test_a_rollout_that_stopped_short_says_what_to_do(client_for: Any, running: Any) -> None:
    from_the_registry(update=False, previous=True)
    rollout(
        state=Rollout.HALTED,
        message="3 new replicas failed in a row. The old replicas keep serving; "
        "a rollback goes back.",
    )
    client = client_for("alice")
    page = client.get("/models/tiny-chat/")
    assert "every 2s" not in page.content.decode()  # a finished rollout is not polled
    text = text_of(page)
    assert "update: halted" in text and "3 new replicas failed in a row." in text
    assert (
        "The old replicas keep serving. Roll back to return to a1b2c3d, or fix the model (the "
        "replicas' messages say why the new ones fail) and its replicas are replaced again."
    ) in text
    assert "The old replicas keep serving. Roll back" in text_of(client.get("/"))

    Rollout.objects.update(
        state=Rollout.FAILED,
        message="refused, the model is unchanged: sha256 mismatch for tiny-chat-q4.gguf",
    )
    text = text_of(client.get("/models/tiny-chat/"))
    assert "update: failed" in text and "sha256 mismatch for tiny-chat-q4.gguf" in text
    assert (
        "Nothing changed: the model keeps serving a1b2c3d. Update again once the registry's "
        "files are right; Check for updates now asks it."
    ) in text


# -- the model page's revisions -------------------------------------------------------


def test_the_model_page_shows_origin_previous_update_and_the_last_check(
    client_for: Any, running: Any
) -> None:
    model = from_the_registry(previous=True)
    MirrorFile.objects.create(
        repo="acme/tiny-chat",
        commit=OLD,
        path="tiny-chat-q4.gguf",
        sha256="0" * 64,
        size=4_000_000_000,
        source_url="http://registry/x",
    )
    Model.objects.filter(pk=model.pk).update(
        update_check_error="last check failed: the registry at http://registry could not list "
        "the branches for acme/tiny-chat: connection refused"
    )
    page = client_for("carol").get("/models/tiny-chat/")
    text = text_of(page)
    assert "Origin acme/tiny-chat , branch main , commit a1b2c3d , fetched 0 minutes ago ." in text
    assert "tiny-chat-q4.gguf 4.0 GB 000000000000…" in text
    assert "What Roll back returns to: commit c0ffee0 , kept in the mirror." in text
    assert "tiny-chat-q4.gguf 4.0 GB 222222222222…" in text
    assert "Commit e4f5a6b : 1 file changed, 4.1 GB; seen 0 minutes ago ." in text
    assert "tiny-chat-q4.gguf 4.1 GB 111111111111…" in text
    assert "0 minutes ago ; the registry is asked every 6h." in text
    assert "connection refused" in text and "last check failed" in text
    html = page.content.decode()
    assert f'title="{OLD}"' in html and f'title="{"1" * 64}"' in html  # the whole ids on hover
    assert "Check for updates now" not in text  # carol may not act on it


def test_a_model_not_from_the_registry_says_so(client_for: Any, running: Any) -> None:
    text = text_of(client_for("alice").get("/models/tiny-chat/"))
    assert "tiny-chat was added by a URL, not served from a registry repository." in text
    assert "None yet: an update keeps the files it replaces in the mirror" in text
    assert "Not checked yet; the registry is asked every 6h." in text
    assert "Check for updates now" in text


# -- check for updates now ------------------------------------------------------------


def test_check_now_is_for_the_owner_and_staff(client_for: Any, running: Any) -> None:
    for headers in (HTMX, {}):
        response = client_for("carol").post("/models/tiny-chat/check", headers=headers)
        assert response.status_code == 403
        assert (
            "tiny-chat belongs to alice; only they or a staff user may ask the registry about it "
            "now. The registry is asked every 6h anyway."
        ) in text_of(response)
    assert Model.objects.get(name="tiny-chat").update_checked_at is None
    assert client_for("carol").get("/models/tiny-chat/check").status_code == 405


def test_check_now_on_a_model_without_a_registry_says_there_is_nothing_to_check(
    client_for: Any, running: Any
) -> None:
    for who in ("alice", "staff"):
        response = client_for(who).post("/models/tiny-chat/check", headers=HTMX)
        assert response.status_code == 200
        assert response.content.decode().lstrip().startswith('<div class="registry full"')
        assert (
            "tiny-chat does not follow a registry: its source is not a file the mirror fetched, "
            "so there is nothing to check it against."
        ) in text_of(response)


def test_check_now_says_when_the_registry_cannot_be_asked(
    client_for: Any, running: Any, server_yaml: Any
) -> None:
    from tests.support.system import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    server_yaml({"registry": {"endpoint": endpoint}})
    from_the_registry(update=False)
    response = client_for("alice").post("/models/tiny-chat/check", headers=HTMX)
    assert response.status_code == 200
    text = text_of(response)
    assert (
        f"The check did not finish for tiny-chat: the registry at {endpoint} could not list the "
        "branches for acme/tiny-chat:"
    ) in text
    assert "The registry is asked again at the next check." in text
    assert "last check failed" in text  # the badge, and the error under Last check
    assert 'class="notice warning"' in response.content.decode()


# -- a fetch's progress ---------------------------------------------------------------


def a_fetch(**fields: Any) -> Fetch:
    values: dict[str, Any] = {
        "repo": "acme/tiny-chat-GGUF",
        "branch": "main",
        "commit": NEW,
        "files": [{"path": "tiny-chat-q4.gguf", "size": 500_000, "sha256": "1" * 64}],
        "bytes_total": 500_000,
        "serve_definition": {"name": "served-chat"},
        **fields,
    }
    return Fetch.objects.create(**values)


def progress(client: Any, fetch: Fetch) -> tuple[str, str]:
    response = client.get(f"/fetches/{fetch.pk}/", headers=HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith(f'<section id="fetch-{fetch.pk}"')
    return html, text_of(response)


def test_the_fetch_progress_follows_a_fetch_until_its_model_is_in(
    client_for: Any, running: Any
) -> None:
    client = client_for("alice")
    fetch = a_fetch()
    html, text = progress(client, fetch)
    assert f'hx-get="/fetches/{fetch.pk}/" hx-trigger="every 1s"' in html
    assert "Serving served-chat from acme/tiny-chat-GGUF" in text
    assert "Commit e4f5a6b of main: tiny-chat-q4.gguf (500 kB)." in text
    assert "0 of 500 kB · 0%" in text and "Waiting for a worker to take the fetch." in text

    Fetch.objects.filter(pk=fetch.pk).update(
        state=Fetch.RUNNING, bytes_done=300_000, message="fetching tiny-chat-q4.gguf"
    )
    html, text = progress(client, fetch)
    assert 'value="60"' in html and "300 of 500 kB · 60%" in text
    assert "fetching tiny-chat-q4.gguf; each file's sha256 is checked before it is kept." in text

    # The last byte is in; the worker adds the model a moment later.
    Fetch.objects.filter(pk=fetch.pk).update(state=Fetch.DONE, finished_at=timezone.now())
    html, text = progress(client, fetch)
    assert "every 1s" in html
    assert "The files are in the mirror and checked; adding served-chat…" in text

    running.add("served-chat")
    html, text = progress(client, fetch)
    assert "hx-get" not in html  # done: it stops asking
    assert "500 of 500 kB · 100%" in text
    assert "served-chat was added; the fleet places its replicas next. Open served-chat →" in text
    assert 'href="/models/served-chat/"' in html

    page = client.get(f"/fetches/{fetch.pk}/")
    assert "<html" in page.content.decode() and "Fetch " in text_of(page)


def test_a_failed_fetch_shows_its_message(client_for: Any, running: Any) -> None:
    fetch = a_fetch(
        state=Fetch.FAILED,
        bytes_done=100_000,
        message="sha256 mismatch for tiny-chat-q4.gguf: the registry says 111, the download is "
        "222; nothing was kept",
    )
    html, text = progress(client_for("alice"), fetch)
    assert "hx-get" not in html
    assert (
        "The fetch failed: sha256 mismatch for tiny-chat-q4.gguf: the registry says 111, the "
        "download is 222; nothing was kept. Nothing was added; fix the cause and serve it again."
    ) in text


def test_a_done_fetch_whose_model_never_came_stops_waiting(client_for: Any, running: Any) -> None:
    fetch = a_fetch(state=Fetch.DONE, finished_at=timezone.now() - timedelta(minutes=5))
    html, text = progress(client_for("alice"), fetch)
    assert "hx-get" not in html
    assert "The files are in the mirror, but served-chat is not in the catalog" in text


def test_an_unknown_fetch_is_404(client_for: Any, users: Any) -> None:
    assert client_for("alice").get("/fetches/999/").status_code == 404


# -- the serve form -------------------------------------------------------------------


def test_the_add_page_offers_serving_from_the_registry(client_for: Any, users: Any) -> None:
    response = client_for("alice").get("/add/")
    html = response.content.decode()
    assert '<form id="serve-form"' in html and 'action="/add/serve"' in html
    assert 'name="file" value="*.gguf"' in html and 'name="branch" value="main"' in html
    assert 'name="min" value="1"' in html
    assert "One GGUF file of a repository in https://huggingface.co is fetched" in text_of(response)
    assert '<form id="add-form"' in html  # pasting a definition is still there


def test_the_serve_form_refuses_what_the_api_refuses(client_for: Any, users: Any) -> None:
    client = client_for("alice")
    response = client.post("/add/serve", {"repo": "not a repo", "min": "-1"}, headers=HTMX)
    assert response.status_code == 400
    html = response.content.decode()
    assert html.lstrip().startswith('<form id="serve-form"')
    repo = html[html.index('id="serve-repo"') :]
    assert (
        "a repository is ORG/NAME, like Qwen/Qwen2.5-0.5B-Instruct-GGUF"
        in repo[: repo.index("</div>")]
    )
    minimum = html[html.index('id="serve-min"') :]
    assert "Ensure this value is greater than or equal to 0." in minimum[: minimum.index("</div>")]
    response = client.post("/add/serve", {"repo": "acme/x", "memory_gb": "lots"}, headers=HTMX)
    assert "Memory is a number of GB, like 4 or 0.5." in text_of(response)
    assert not Fetch.objects.exists()


# -- against a registry ---------------------------------------------------------------


@pytest.fixture(scope="module")
def olah(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("console-registry")
    weights = {}
    for seed in (1, 2):
        weights[seed] = folder / f"weights-{seed}.gguf"
        write_tiny_model(weights[seed], seed=seed)
    with LocalRegistry(folder / "registry") as registry:
        yield {"registry": registry, "weights": weights}


@pytest.fixture
def registry(
    olah: dict[str, Any], server_yaml: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """The running registry, with a repository of this test's own holding the first weights."""
    repo = "acme/" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[5:60].strip("-")
    commit = olah["registry"].commit(repo, {"tiny-chat-q4.gguf": olah["weights"][1]})
    server_yaml(
        {
            "registry": {"endpoint": olah["registry"].endpoint},
            "mirror": {"root": str(tmp_path / "mirror")},
        }
    )
    return {**olah, "repo": repo, "commit": commit}


@needs_registry
def test_serving_creates_a_fetch_and_follows_it_until_the_model_is_in(
    client_for: Any, running: Any, registry: dict[str, Any]
) -> None:
    client = client_for("alice")
    response = client.post(
        "/add/serve",
        {"repo": registry["repo"], "file": "*.gguf", "branch": "main", "memory_gb": "1"},
        headers=HTMX,
    )
    assert response.status_code == 200, text_of(response)
    fetch = Fetch.objects.get()
    assert response["HX-Push-Url"] == f"/fetches/{fetch.pk}/"
    html = response.content.decode()
    assert html.lstrip().startswith(f'<section id="fetch-{fetch.pk}"')
    assert "every 1s" in html and "Serving tiny-chat-q4 from" in text_of(response)
    assert (fetch.state, fetch.commit, fetch.requested_by.username, fetch.door) == (
        Fetch.QUEUED,
        registry["commit"],
        "alice",
        "console",
    )
    assert fetch.serve_definition["profiles"][0]["memory_gb"] == 1

    fetches.run_fetch(fetch.pk)  # what the worker does
    html, text = progress(client, fetch)
    assert "tiny-chat-q4 was added; the fleet places its replicas next." in text
    assert 'href="/models/tiny-chat-q4/"' in html and "hx-get" not in html
    model = Model.objects.get(name="tiny-chat-q4")
    assert model.owner.username == "alice"
    assert model.origin["commit"] == registry["commit"]
    assert AuditEntry.objects.get(action="add", model_name="tiny-chat-q4").door == "console"

    # Without JavaScript the form leads to the fetch's own page.
    response = client.post(
        "/add/serve", {"repo": registry["repo"], "name": "second-chat", "memory_gb": "1"}
    )
    assert response.status_code == 302
    assert response["Location"] == f"/fetches/{Fetch.objects.latest('pk').pk}/"


@needs_registry
def test_the_form_serves_a_snapshot_for_vllm(
    client_for: Any, running: Any, registry: dict[str, Any], tmp_path: Path
) -> None:
    client = client_for("alice")
    html = client.get("/add/").content.decode()
    engine = html[html.index('id="serve-engine"') :]
    assert (
        '<option value="vllm">vllm: a Hugging Face snapshot' in engine[: engine.index("</select>")]
    )
    snapshot = make_tiny_llama(tmp_path / "snapshot", seed=1)
    files = {path.name: path for path in snapshot.iterdir()}
    repo = registry["repo"] + "-hf"
    registry["registry"].commit(repo, files)
    # The file pattern left at its first value (*.gguf): the snapshot's own files.
    response = client.post(
        "/add/serve",
        {"repo": repo, "engine": "vllm", "file": "*.gguf", "memory_gb": "3"},
        headers=HTMX,
    )
    assert response.status_code == 200, text_of(response)
    fetch = Fetch.objects.get()
    definition = fetch.serve_definition
    assert definition["engine"] == "vllm" and definition["source"].endswith("/config.json")
    assert sorted(definition["files"]) == sorted(set(files) - {"config.json"})
    fetches.run_fetch(fetch.pk)
    model = Model.objects.get(name=definition["name"])
    assert model.engine == "vllm" and sorted(model.files) == sorted(definition["files"])
    # A GGUF repository is no snapshot: refused in the form, nothing fetched.
    refused = client.post("/add/serve", {"repo": registry["repo"], "engine": "vllm"}, headers=HTMX)
    assert refused.status_code == 400
    assert "has no config.json among the files" in text_of(refused)
    assert Fetch.objects.count() == 1


@needs_registry
def test_serve_refusals_are_shown_in_the_form(
    client_for: Any, running: Any, registry: dict[str, Any]
) -> None:
    client = client_for("alice")
    repo, commit = registry["repo"], registry["commit"]

    def refused(status: int, **data: str) -> str:
        response = client.post("/add/serve", {"repo": repo, **data}, headers=HTMX)
        assert response.status_code == status, text_of(response)
        assert response.content.decode().lstrip().startswith('<form id="serve-form"')
        return text_of(response)

    assert (
        f"{repo} has no GGUF file matching '*q8*' on main ({commit[:7]}). Name the file with "
        "a pattern (a glob such as '*q4_k_m.gguf')."
    ) in refused(400, file="*q8*")
    assert f"Cannot serve {repo}: {repo} has no branch 'dev'; its branches are main." in refused(
        400, branch="dev"
    )
    assert "A model named tiny-chat already exists; choose another name." in refused(
        409, name="tiny-chat"
    )
    registry["registry"].commit(repo, {"tiny-chat-q8.gguf": registry["weights"][2]})
    assert (
        f"2 GGUF files of {repo} match '*.gguf': tiny-chat-q4.gguf, tiny-chat-q8.gguf. A model "
        "serves one; narrow the file pattern."
    ) in refused(400)
    assert not Fetch.objects.exists()
    # Without htmx the refusal comes back on the whole page, with its own status.
    response = client.post("/add/serve", {"repo": repo, "branch": "dev"})
    assert response.status_code == 400 and "<html" in response.content.decode()


@needs_registry
def test_check_now_finds_new_weights_and_the_update_goes_through(
    client_for: Any, running: Any, registry: dict[str, Any]
) -> None:
    client = client_for("alice")
    client.post("/add/serve", {"repo": registry["repo"], "memory_gb": "1"}, headers=HTMX)
    fetches.run_fetch(Fetch.objects.get().pk)
    old = registry["commit"]

    response = client.post("/models/tiny-chat-q4/check", headers=HTMX)
    assert f"Checked: tiny-chat-q4 is on the newest files of {registry['repo']} (main, " in (
        text_of(response)
    )
    new = registry["registry"].commit(
        registry["repo"], {"tiny-chat-q4.gguf": registry["weights"][2]}, message="retrained"
    )
    response = client.post("/models/tiny-chat-q4/check", headers=HTMX)
    assert response.status_code == 200
    text = text_of(response)
    assert f"Checked: update available: {old[:7]} → {new[:7]}, 1 file, 501 kB." in text
    assert f"Commit {new[:7]} : 1 file changed, 501 kB; seen 0 minutes ago ." in text
    row = row_of(client.get("/").content.decode(), "tiny-chat-q4")
    assert f"update available: {old[:7]} → {new[:7]}, 1 file, 501 kB" in row

    client.post("/models/tiny-chat-q4/update", headers=HTMX)
    fetches.run_fetch(Fetch.objects.latest("pk").pk)  # it also advances the rollout to the swap
    advance_rollouts()
    text = text_of(client.get("/models/tiny-chat-q4/registry", headers=HTMX))
    assert f"commit {new[:7]} , fetched 0 minutes ago" in text
    assert f"What Roll back returns to: commit {old[:7]} , kept in the mirror." in text
    assert "update: rolling" in text or "update: done" in text

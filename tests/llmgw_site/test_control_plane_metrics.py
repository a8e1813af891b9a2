"""The control plane's metrics beside the gateway's on one /metrics: reconcile passes and Celery
tasks counted in the worker's processes, rollouts by state and each node's heartbeat age read
from the database at the scrape, the engines' numbers added up per model."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import requests

from core import metrics as core_metrics
from gateway.metrics import (
    ControlPlaneFigures,
    EngineFigures,
    control_plane_exposition,
    model_exposition,
)
from tests.support.system import System, wait_for


def samples(text: str, name: str) -> dict[str, float]:
    """The samples of one metric: their labels as written -> value."""
    found = {}
    for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        found[labels] = float(value)
    return found


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = System(tmp_path_factory.mktemp("control-metrics"))
    with running.running():
        running.add_ready_nodes(memory_gb=1, cores=1, names=("node-a",))
        yield running


def scrape(system: System) -> str:
    answer = requests.get(f"{system.url}/metrics", timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.text


def test_one_scrape_shows_the_workers_passes_and_tasks_and_the_databases_state(
    system: System,
) -> None:
    # Reconcile passes run every second (beat), in the worker's processes: the gateway's
    # /metrics adds up their files with its own.
    def passes_done() -> float:
        return samples(scrape(system), "llmgw_reconcile_passes_total").get('{outcome="done"}', 0.0)

    wait_for(lambda: passes_done() >= 3, timeout=60, what="three reconcile passes counted")
    text = scrape(system)
    assert samples(text, "llmgw_reconcile_duration_seconds_count")[""] >= 3
    tasks = samples(text, "llmgw_tasks_total")
    assert tasks['{outcome="succeeded",task="fleet.tasks.reconcile"}'] >= 3, tasks
    assert not any('outcome="failed"' in labels for labels in tasks), tasks
    assert samples(text, "llmgw_task_duration_seconds_count")['{task="fleet.tasks.reconcile"}'] >= 3
    # And the gateway's own numbers are still there, in the same answer.
    assert "llmgw_gateway_database_up 1.0" in text

    # Read from the database at the scrape: every state of a rollout, and the node's last
    # heartbeat (it sends one every 2 s).
    assert samples(text, "llmgw_rollouts") == {
        f'{{state="{state}"}}': 0.0 for state in ("fetching", "rolling", "done", "failed", "halted")
    }
    age = samples(text, "llmgw_node_heartbeat_age_seconds")['{node="node-a"}']
    assert 0 <= age < 10


def test_a_node_silent_shows_its_heartbeat_age_growing(system: System) -> None:
    system.add_node("node-quiet", memory_gb=1, cores=1, start=False)
    text = scrape(system)
    # Never heard: no sample, rather than a made-up age.
    assert '{node="node-quiet"}' not in samples(text, "llmgw_node_heartbeat_age_seconds")
    process = system.processes["node-node-a"]
    process.kill()
    process.wait(timeout=10)
    before = samples(scrape(system), "llmgw_node_heartbeat_age_seconds")['{node="node-a"}']
    wait_for(
        lambda: (
            samples(scrape(system), "llmgw_node_heartbeat_age_seconds")['{node="node-a"}']
            > before + 3
        ),
        timeout=30,
        what="node-a's heartbeat age growing",
    )


def test_the_engines_numbers_are_added_up_per_model() -> None:
    engines = [
        EngineFigures("chat", "r1", "a", {"tokens_per_second": 10.5, "slots": 4, "busy_slots": 1}),
        EngineFigures("chat", "r2", "b", {"tokens_per_second": 2.0, "slots": 4, "waiting": 3}),
        EngineFigures('odd"name', "r3", "a", {"slots": 1, "busy_slots": "x"}),  # not a number
    ]
    text = model_exposition(engines).decode()
    assert samples(text, "llmgw_model_tokens_per_second") == {'{model="chat"}': 12.5}
    assert samples(text, "llmgw_model_slots") == {
        '{model="chat"}': 8.0,
        '{model="odd\\"name"}': 1.0,
    }
    assert samples(text, "llmgw_model_slots_busy") == {'{model="chat"}': 1.0}
    assert samples(text, "llmgw_model_requests_waiting") == {'{model="chat"}': 3.0}
    assert "# TYPE llmgw_model_slots gauge" in text


def test_the_control_plane_text_names_every_rollout_state_and_only_heard_nodes() -> None:
    figures = ControlPlaneFigures(
        rollouts={"fetching": 1, "done": 4}, heartbeat_ages={"a": 1.5, "b": None}
    )
    text = control_plane_exposition(figures).decode()
    assert samples(text, "llmgw_rollouts") == {'{state="fetching"}': 1.0, '{state="done"}': 4.0}
    assert samples(text, "llmgw_node_heartbeat_age_seconds") == {'{node="a"}': 1.5}


def test_task_names_outside_llmgw_are_one_label() -> None:
    assert core_metrics.task_label("registry.tasks.run_fetch") == "registry.tasks.run_fetch"
    assert core_metrics.task_label("celery.backend_cleanup") == "other"
    assert core_metrics.task_label(None) == "other"


def test_scrapes_read_the_database_at_most_once_in_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """/metrics may be open to anyone: a hundred scrapes in a row read the control plane's
    state once, not a hundred times."""
    from access import selectors
    from gateway import app

    reads = []

    def figures() -> ControlPlaneFigures:
        reads.append(1)
        return ControlPlaneFigures(rollouts={"done": len(reads)}, heartbeat_ages={})

    engine_reads = []
    serving = (EngineFigures("chat", "r1", "gpu-1", {"slots": 4}),)

    def engines() -> tuple[EngineFigures, ...]:
        engine_reads.append(1)
        return serving

    monkeypatch.setattr(selectors, "control_plane_figures", figures)
    monkeypatch.setattr(app, "engine_figures", engines)
    gateway = SimpleNamespace(control_plane_read=None)
    # No database here: closing the connection would touch the one an earlier database test
    # left open, which pytest-django refuses outside a database test.
    monkeypatch.setattr(app, "connection", SimpleNamespace(close=lambda: None))
    read = [app._database_figures(gateway) for _ in range(100)]
    assert len(reads) == 1 and len(engine_reads) == 1  # the engines too: 20,000 rows at scale
    assert read == [(serving, control_plane_exposition(ControlPlaneFigures({"done": 1}, {})))] * 100
    monkeypatch.setattr(app, "CONTROL_PLANE_READ_SECONDS", 0.0)
    app._database_figures(gateway)
    assert len(reads) == 2 and len(engine_reads) == 2


@pytest.mark.django_db(transaction=True)
def test_a_scrape_leaves_no_connection_open_in_the_thread_that_read_the_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The read runs on one of the event loop's executor threads (asyncio.to_thread): a
    connection kept there (CONN_MAX_AGE) would stay open, one per thread, for the process's
    life, and held the test databases open at the end of a run."""
    from django.db import connection

    from gateway import app

    if connection.vendor == "sqlite" and connection.is_in_memory_db():
        pytest.skip("Django never closes an in-memory SQLite database (the tests' own)")
    held: list[object] = []

    def scrape() -> None:
        fresh = SimpleNamespace(control_plane_read=None)
        assert app._database_figures(fresh)[1].startswith(b"# HELP")
        held.append(connection.connection)

    thread = threading.Thread(target=scrape)
    thread.start()
    thread.join(timeout=30)
    assert held == [None]

"""The agent's cheap heartbeat against the real control plane (pytest-django's live server): it
renews while nothing on the node changes, reports a change at once, and converges after a
restart or an answer lost on the way back (level-triggered)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import requests

from core.actor import Actor
from fleet.models import Node, Replica
from fleet.reconciler import reconcile_pass
from fleet.services import node_add
from llmgw.node.agent import (
    FULL_REPORT_SECONDS,
    Agent,
    full_report_seconds,
    next_full_report,
    report_digest,
)
from llmgw.node.config import NodeConfig
from tests.support.fleet import Fleet

pytestmark = [pytest.mark.django_db(transaction=True)]


class Sent:
    """What the agent POSTs, by path, through its real session; `drop` loses the next answer
    on the way back (the control plane did the work; the agent never hears of it)."""

    def __init__(self, agent: Agent) -> None:
        self.paths: list[str] = []
        self.drop = 0
        real = agent.session.post

        def post(url: str, **kwargs: Any) -> requests.Response:
            self.paths.append(url.rsplit("/", 1)[-1])
            response = real(url, **kwargs)
            if self.drop:
                self.drop -= 1
                raise requests.ConnectionError("the answer was lost on the way back")
            return response

        agent.session.post = post  # type: ignore[method-assign]

    def take(self) -> list[str]:
        taken, self.paths = self.paths, []
        return taken


@pytest.fixture
def fleet(users: dict[str, Any]) -> Fleet:
    return Fleet(users["staff"], users["alice"])


@pytest.fixture
def node(live_server: Any, users: dict[str, Any], tmp_path: Path) -> Any:
    """node(name) -> (agent, sent): a registered node's agent, not started, and its requests."""

    def make(name: str = "n1") -> tuple[Agent, Sent]:
        _, token = node_add(actor=Actor.for_user(users["staff"], "api"), name=name)
        config = NodeConfig(
            server=live_server.url,
            token=token,
            memory_gb=8,
            cores=4,
            cache=tmp_path / name,
            port_range=(43000, 43099),
        )
        agent = Agent(config)
        agent.cache.prepare()
        return agent, Sent(agent)

    return make


def restarted(agent: Agent) -> tuple[Agent, Sent]:
    again = Agent(NodeConfig(**agent.config.__dict__))
    again.cache.prepare()
    return again, Sent(again)


def test_it_renews_while_nothing_changes_and_reports_in_full_every_few_minutes(
    node: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, sent = node()
    agent.heartbeat()
    stored = Node.objects.get()
    assert stored.report_digest == agent.acked_digest == report_digest(agent.heartbeat_body())
    agent.heartbeat()
    agent.heartbeat()
    assert sent.take() == ["heartbeat", "renew", "renew"]
    assert Node.objects.get().last_heartbeat > stored.last_heartbeat
    # The whole report goes again between a quarter and a period and a quarter after the first.
    assert agent.full_due is not None
    left = agent.full_due - time.monotonic()
    assert 0.25 * FULL_REPORT_SECONDS - 1 <= left <= 1.25 * FULL_REPORT_SECONDS
    # A report sent because something changed does not move the periodic one.
    due = agent.full_due
    agent.acked_digest = "0" * 64  # as if the report had changed since the last taken
    agent.heartbeat()
    assert sent.take() == ["heartbeat"] and agent.full_due == due
    agent.full_due = time.monotonic() + 1
    agent.heartbeat()
    assert sent.take() == ["renew"]
    agent.full_due = due = time.monotonic() - 0.001
    agent.heartbeat()
    assert sent.take() == ["heartbeat"]
    assert 0.75 * FULL_REPORT_SECONDS <= agent.full_due - due <= 1.25 * FULL_REPORT_SECONDS


def test_the_periodic_report_keeps_its_pace_and_never_catches_up() -> None:
    now = 1000.0
    first = next_full_report(None, now)
    assert now + 0.25 * FULL_REPORT_SECONDS <= first <= now + 1.25 * FULL_REPORT_SECONDS
    # Taken a little late (the beat's own interval): the next is a period after it was due.
    second = next_full_report(first, first + 3)
    assert first + 0.75 * FULL_REPORT_SECONDS <= second <= first + 1.25 * FULL_REPORT_SECONDS
    # A node away for an hour reports once on its return, then a period later.
    back = first + 3600
    assert back < next_full_report(first, back) <= back + 1.25 * FULL_REPORT_SECONDS


def test_the_whole_reports_period_differs_from_node_to_node() -> None:
    """Nodes started together (or told at once to report) would otherwise send their whole
    reports in the same second every FULL_REPORT_SECONDS: measured at 5,000 simulated nodes, that
    wave of reports alone timed out at the web and had nodes declared lost."""
    periods = [full_report_seconds() for _ in range(1000)]
    assert all(0.75 * FULL_REPORT_SECONDS <= p <= 1.25 * FULL_REPORT_SECONDS for p in periods)
    assert max(periods) - min(periods) > 0.4 * FULL_REPORT_SECONDS


def test_nodes_started_together_spread_their_first_periodic_report_over_a_whole_period() -> None:
    """5,000 nodes started within the same minute send their first periodic whole report at the
    fleet's steady rate (a period's worth spread over a period), not in a wave a period later."""
    firsts = sorted(next_full_report(None, 0.0) for _ in range(5000))
    assert firsts[0] >= 0.25 * FULL_REPORT_SECONDS and firsts[-1] <= 1.25 * FULL_REPORT_SECONDS
    assert firsts[-1] - firsts[0] > 0.9 * FULL_REPORT_SECONDS
    # No minute holds much more than its share (5,000 nodes over 5 minutes: 1,000 a minute).
    busiest = max(
        sum(1 for f in firsts if start <= f < start + 60)
        for start in range(
            int(0.25 * FULL_REPORT_SECONDS), int(1.25 * FULL_REPORT_SECONDS) - 59, 10
        )
    )
    assert busiest < 1.3 * 5000 * 60 / FULL_REPORT_SECONDS


def test_new_orders_arrive_by_renewal_and_the_change_they_make_is_reported_at_once(
    node: Any, fleet: Fleet
) -> None:
    agent, sent = node()
    agent.heartbeat()
    sent.take()
    fleet.add("m", min_replicas=1, max_replicas=1)
    reconcile_pass()
    (replica,) = Replica.objects.all()
    agent.heartbeat()  # a renewal, answered with the replica to run
    assert sent.take() == ["renew"]
    assert list(agent.replicas) == [str(replica.pk)]
    assert agent.generation == Node.objects.get().generation
    # The replica is fetching now (its source does not answer; it fails soon): the report
    # changed, so the next beat carries it whole, without waiting for FULL_REPORT_SECONDS.
    agent.heartbeat()
    assert sent.take() == ["heartbeat"]
    replica.refresh_from_db()
    assert replica.state in ("fetching", "failed")


def test_an_answer_lost_on_the_way_back_is_asked_for_again(node: Any, fleet: Fleet) -> None:
    agent, sent = node()
    agent.heartbeat()
    sent.take()
    fleet.add("m", min_replicas=1, max_replicas=1)
    reconcile_pass()
    sent.drop = 1
    agent.heartbeat()  # the renewal's answer (the new replica) never arrives
    assert agent.replicas == {}
    agent.heartbeat()  # the agent still names the old generation: the orders come again
    assert sent.take() == ["renew", "renew"]
    assert [r.spec.id for r in agent.replicas.values()] == [str(Replica.objects.get().pk)]


def test_a_whole_report_whose_answer_was_lost_is_sent_again(node: Any) -> None:
    agent, sent = node()
    sent.drop = 1
    agent.heartbeat()
    assert agent.acked_digest is None  # the control plane took it; the agent cannot know
    agent.heartbeat()
    agent.heartbeat()
    assert sent.take() == ["heartbeat", "heartbeat", "renew"]


def test_a_restarted_agent_reports_whole_and_gets_everything_it_should_run(
    node: Any, fleet: Fleet
) -> None:
    agent, _ = node()
    agent.heartbeat()
    fleet.add("m", min_replicas=1, max_replicas=1)
    reconcile_pass()
    # The agent dies before its next beat; a new one starts with nothing known.
    again, sent = restarted(agent)
    again.heartbeat()
    assert sent.take() == ["heartbeat"]
    assert [r.spec.id for r in again.replicas.values()] == [str(Replica.objects.get().pk)]


def test_a_control_plane_that_lost_the_report_asks_for_it(node: Any) -> None:
    """A database restored from a backup holds an older report: the renewal is refused and the
    whole report follows in the same beat."""
    agent, sent = node()
    agent.heartbeat()
    Node.objects.update(report_digest="0" * 64)
    agent.heartbeat()
    assert sent.take() == ["heartbeat", "renew", "heartbeat"]
    assert Node.objects.get().report_digest == agent.acked_digest


def test_a_control_plane_without_renewals_gets_whole_reports(node: Any) -> None:
    from tests.support.fake_control_plane import fake_control_plane

    agent, _ = node()
    with fake_control_plane(token=agent.config.token) as plane:
        agent.servers = (plane.url,)
        agent.server = plane.url
        agent.heartbeat()
        agent.heartbeat()
        agent.heartbeat()
        assert len(plane.heartbeats) == 3
    assert agent.renewing is False

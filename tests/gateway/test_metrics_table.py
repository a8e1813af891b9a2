"""The gateway's metric names, types and labels, as a scrape shows them: dashboards and alerts
query them, so renaming one, changing its type or its labels must be a decision, made here."""

from __future__ import annotations

import dataclasses

from gateway.metrics import GATEWAY_METRICS, Metrics, _create

# (name, type, labels in order), taken from the metrics as they were declared on 2026-12-07.
EXPOSED = (
    ("llmgw_gateway_requests", "counter", ("model", "answered_by", "endpoint", "status")),
    ("llmgw_gateway_request_duration_seconds", "histogram", ("model", "endpoint")),
    ("llmgw_gateway_tokens", "counter", ("model", "kind")),
    ("llmgw_gateway_requests_in_flight", "gauge", ("model",)),
    ("llmgw_gateway_fallbacks", "counter", ("model", "fallback")),
    ("llmgw_gateway_retries", "counter", ("model",)),
    ("llmgw_gateway_refused", "counter", ("reason",)),
    ("llmgw_gateway_queue_seconds", "histogram", ("model", "outcome")),
    ("llmgw_gateway_queue_depth", "gauge", ("model",)),
    ("llmgw_gateway_forward_body_bytes", "gauge", ()),
    ("llmgw_gateway_forward_bodies_reading", "gauge", ()),
    ("llmgw_gateway_forward_clients_entries", "gauge", ()),
    ("llmgw_gateway_forward_refused", "counter", ("reason",)),
    ("llmgw_gateway_forwarded_for_ignored", "counter", ()),
    ("llmgw_gateway_keys_held", "gauge", ()),
    ("llmgw_gateway_key_refresh_seconds", "histogram", ()),
    ("llmgw_gateway_limited", "counter", ("limit", "subject")),
    ("llmgw_gateway_keys_limited", "gauge", ()),
    ("llmgw_gateway_limit_slots_held", "gauge", ()),
    ("llmgw_gateway_limits_redis_errors", "counter", ()),
    ("llmgw_gateway_limits_redis_dropped", "counter", ()),
    ("llmgw_gateway_limits_redis_fallback", "counter", ("fallback",)),
    ("llmgw_gateway_limits_redis_down", "gauge", ()),
    ("llmgw_gateway_database_up", "gauge", ()),
    ("llmgw_gateway_database_outages", "counter", ()),
    ("llmgw_gateway_replica_names_entries", "gauge", ()),
    ("llmgw_gateway_traffic_entries", "gauge", ()),
    ("llmgw_gateway_key_uses_entries", "gauge", ()),
    ("llmgw_gateway_demand_entries", "gauge", ()),
    ("llmgw_gateway_snapshot_entries", "gauge", ()),
    ("llmgw_gateway_replicas_reread", "counter", ()),
    ("llmgw_gateway_nodes_held", "gauge", ()),
    ("llmgw_gateway_node_requests_to_web", "gauge", ()),
    ("llmgw_gateway_node_requests_queued", "gauge", ()),
    ("llmgw_gateway_node_requests_shed", "counter", ()),
    ("llmgw_gateway_prefix_entries", "gauge", ()),
    ("llmgw_gateway_queue_flows_entries", "gauge", ()),
    ("llmgw_gateway_limits_redis_pending_entries", "gauge", ()),
    ("llmgw_gateway_access_log_lines", "counter", ()),
    ("llmgw_gateway_access_log_dropped", "counter", ("reason",)),
)


def exposed_by(board: Metrics) -> list[tuple[str, str, tuple[str, ...] | None]]:
    """What a scrape of a fresh board shows: each metric's name and type, and the labels of its
    series once each labelled metric has one (its label names given as its values, in order)."""
    labels_of = {name: labels for name, _, labels in EXPOSED}
    for attribute in dataclasses.fields(board):
        if attribute.name in ("registry", "folder"):
            continue
        metric = getattr(board, attribute.name)
        [family] = metric.describe()
        labels = labels_of.get(family.name, ())
        if labels:
            metric.labels(*labels)
    shown: list[tuple[str, str, tuple[str, ...] | None]] = []
    for family in board.registry.collect():
        series = {
            tuple((key, value) for key, value in sample.labels.items() if key != "le")
            for sample in family.samples
        }
        if not series:  # a labelled metric not in EXPOSED: it has no series to show
            shown.append((family.name, family.type, None))
            continue
        assert len(series) == 1, (family.name, series)
        [pairs] = series
        # Each value is its own label's name: the labels are in the order they were declared.
        assert all(key == value for key, value in pairs), (family.name, pairs)
        shown.append((family.name, family.type, tuple(key for key, _ in pairs)))
    return shown


def test_it_exposes_every_metric_under_the_same_name_type_and_labels() -> None:
    assert exposed_by(_create(None)) == list(EXPOSED)


def test_it_makes_one_metric_per_row_of_the_table() -> None:
    names = [spec.name for spec in GATEWAY_METRICS]
    assert len(set(names)) == len(names)
    assert all(spec.help for spec in GATEWAY_METRICS)

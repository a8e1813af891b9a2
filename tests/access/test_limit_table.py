"""The limits table (llmgw.limitdefs.LIMITS) and every door that derives from it agree: a limit in
the table is a field of keys and teams, in the API's answers and inputs, on the admin's and the
console's forms, a CLI flag, watched by the triggers, read by the gateway and named in its 429."""

from __future__ import annotations

import argparse

import pytest
from django.db import models

from access import admin as access_admin
from access import api, routed, triggers
from access.models import GatewayKey, Team
from console.key_forms import KeyLimitsForm
from console.views.teams import TeamLimitsForm
from gateway import errors
from gateway.state import _KEY_ROWS
from llmgw.ctl.limits import add_limit_flags
from llmgw.limitdefs import COUNTERS, LIMITS, UNITS, WINDOWS

NAMES = [limit.name for limit in LIMITS]


def test_each_row_is_well_formed() -> None:
    assert len(set(NAMES)) == len(NAMES) == len(COUNTERS)
    for limit in LIMITS:
        assert limit.unit in UNITS and limit.window in WINDOWS, limit
        assert limit.name.isidentifier() and limit.label and limit.used_label, limit


@pytest.mark.parametrize("model", [GatewayKey, Team])
def test_keys_and_teams_have_a_nullable_counter_per_limit_and_no_other(model: type) -> None:
    counters = [
        f.name for f in model._meta.get_fields() if isinstance(f, models.PositiveBigIntegerField)
    ]
    assert counters == NAMES
    for name in NAMES:
        field = model._meta.get_field(name)
        assert field.null and field.blank


@pytest.mark.parametrize(
    "serializer",
    [api.LimitsOut, api.CeilingsOut, api.PolicyFiguresOut, api.PolicyFiguresInput, api.LimitsInput],
)
def test_the_apis_serializers_carry_every_limit(serializer: type) -> None:
    fields = list(serializer().fields)
    assert fields[: len(NAMES)] == NAMES


def test_the_forms_carry_every_limit() -> None:
    for form in (KeyLimitsForm, TeamLimitsForm, access_admin.LimitsForm):
        assert list(form.base_fields)[: len(NAMES)] == NAMES, form
    policy = list(access_admin.KeyPolicyForm.base_fields)
    assert {f"{p}_{n}" for n in NAMES for p in ("default", "max")} <= set(policy)


def test_the_cli_has_a_flag_per_limit() -> None:
    parser = argparse.ArgumentParser()
    add_limit_flags(parser, key=True)
    for limit in LIMITS:
        assert getattr(parser.parse_args([limit.flag, "5"]), limit.name) == 5


def test_the_triggers_watch_and_the_gateway_reads_every_limit() -> None:
    assert set(NAMES) <= set(triggers.LIMIT_COLUMNS)
    assert set(NAMES) <= set(routed.TEAM_LIMITS)
    assert all(f"k.{name}," in _KEY_ROWS for name in NAMES)


@pytest.mark.parametrize("limit", LIMITS, ids=NAMES)
def test_a_refusal_names_each_limit(limit: object) -> None:
    refusal = errors.limited(
        limit.name, team=None, figure=1, used=1, retry_after=3, resets_at="x", headers={}
    )
    assert refusal.status == 429 and limit.figure(1) in refusal.payload["error"]["message"]

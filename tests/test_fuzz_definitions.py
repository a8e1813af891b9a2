"""Random and hostile definitions through every door that takes one: a 4xx with a message, nothing
written, and the process still answering, each example within the deadline.

Every generated document carries at least one thing no field accepts (a deep structure, a huge
number, a number that is not finite, a NUL, a duplicate or unknown key, an alias bomb, a wrong
type) or is random text, so a 2xx is always a failure.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalog.models import AuditEntry, Model
from tests.factories import definition

pytestmark = pytest.mark.django_db

MARK = "__HOSTILE__"
FIELDS = [
    "name",
    "source",
    "description",
    "owner",
    "class",
    "sha256",
    "min_replicas",
    "max_replicas",
    "idle_timeout",
    "context_length",
    "fallbacks",
    "profiles",
    "adapters",
]
NUMERIC = {"min_replicas", "max_replicas", "context_length"}

# Raw fragments, valid JSON (and so YAML) syntax, that no field takes.
deep_lists = st.integers(2, 3000).map(lambda d: "[" * d + "]" * d)
deep_objects = st.integers(1, 3000).map(lambda d: '{"a": ' * d + "1" + "}" * d)
huge_integers = st.integers(41, 6000).map(lambda n: "9" * n)
nul_strings = st.text(max_size=20).map(lambda t: json.dumps(t + "\x00" + t))
odd_objects = st.dictionaries(st.text(min_size=1, max_size=8), st.integers(), min_size=1).map(
    json.dumps
)
always_bad = st.one_of(deep_lists, deep_objects, huge_integers, nul_strings, odd_objects)
not_finite_json = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"])
not_finite_yaml = st.sampled_from([".nan", ".inf", "-.inf", "1.0e+999"])
wrong_for_numbers = st.one_of(
    st.text(alphabet="abcxyz\u202e\u0301 ", min_size=1, max_size=10).map(json.dumps),
    st.just("[1]"),
)


DOORS = ["api-models", "api-plan", "console-add"]


@st.composite
def hostile_requests(draw: Any) -> tuple[str, str, str]:
    """(door, text, "json" | "yaml"): a definition with a hostile part, or random text."""
    door = draw(st.sampled_from(DOORS))
    # The console reads YAML only; YAML reads 1e999 or NaN as text, not as numbers.
    kind = "yaml" if door == "console-add" else draw(st.sampled_from(["json", "yaml"]))
    shape = draw(
        st.sampled_from(["field", "field", "field", "duplicate", "unknown", "bomb", "text"])
    )
    if shape == "text":
        text = draw(st.text(max_size=300))
        return door, text, kind
    if shape == "bomb":
        width, levels = draw(st.integers(8, 12)), draw(st.integers(6, 9))
        lines = ['a0: &a0 "lol"']
        for level in range(1, levels + 1):
            lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
        return door, "\n".join(lines) + f"\nname: *a{levels}\n", "yaml"
    base = definition()
    if shape == "unknown":
        base["x-" + draw(st.text(min_size=1, max_size=10))] = draw(st.integers())
        text = json.dumps(base)
    elif shape == "duplicate":
        text = json.dumps(base)[:-1] + ', "name": ' + json.dumps(draw(st.text(max_size=10))) + "}"
    else:
        field = draw(st.sampled_from(FIELDS))
        base[field] = MARK
        fragments = [always_bad, not_finite_json if kind == "json" else not_finite_yaml]
        if field in NUMERIC:
            fragments.append(wrong_for_numbers)
        text = json.dumps(base).replace(json.dumps(MARK), draw(st.one_of(*fragments)))
    return door, text, kind


@pytest.fixture
def console(users: dict[str, Any]) -> Any:
    from django.test import Client

    client = Client()
    client.force_login(users["alice"])
    return client


def _send(api: Any, client: Any, door: str, text: str, kind: str) -> Any:
    content_type = "application/json" if kind == "json" else "application/yaml"
    if door == "api-models":
        return api.post("/api/v1/models?source_check=false", text, content_type=content_type)
    if door == "api-plan":
        return api.post("/api/v1/plan", text, content_type=content_type)
    return client.post(
        "/add/model",
        {"definition": text, "skip_source_check": "on"},
        headers={"HX-Request": "true", "HX-Current-URL": "http://testserver/add/"},
    )


@settings(
    max_examples=80,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=hostile_requests())
def test_hostile_definitions_are_refused_and_change_nothing(
    api: Any, console: Any, request: tuple[str, str, str]
) -> None:
    door, text, kind = request
    response = _send(api("alice"), console, door, text, kind)
    assert 400 <= response.status_code < 500, (response.status_code, text[:200])
    if door == "console-add":
        html = response.content.decode()
        assert any(mark in html for mark in ('role="alert"', 'class="problem"', "errorlist")), html
    else:
        detail = response.json()["detail"]
        assert isinstance(detail, str) and len(detail) > 10
    assert not Model.objects.exists()
    assert not AuditEntry.objects.exists()
    # The worker that took the request still answers.
    assert api("alice").get("/api/v1/models").status_code == 200

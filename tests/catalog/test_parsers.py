"""Hostile request bodies on /api/v1/: each is a 4xx that says what is wrong, and writes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from catalog.models import AuditEntry, Model
from tests.factories import definition

pytestmark = pytest.mark.django_db

NO_CHECK = "/api/v1/models?source_check=false"


def laughs(levels: int, width: int = 10) -> str:
    """A "billion laughs" definition: each level an alias list of `width` copies of the last."""
    lines = ['a0: &a0 "lol"']
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    return "\n".join(lines) + f"\nname: *a{levels}\n"


def deep_yaml(depth: int) -> str:
    return "name: x\ndescription: " + "[" * depth + "]" * depth + "\n"


def deep_json(depth: int) -> str:
    return '{"name": "x", "description": ' + "[" * depth + "]" * depth + "}"


def post_yaml(client: Any, text: str, path: str = NO_CHECK) -> Any:
    return client.post(path, text, content_type="application/yaml")


def post_json(client: Any, text: str, path: str = NO_CHECK) -> Any:
    return client.post(path, text, content_type="application/json")


@pytest.fixture
def nothing_written() -> Any:
    yield
    assert Model.objects.count() == 0
    assert AuditEntry.objects.count() == 0


@pytest.mark.parametrize("path", [NO_CHECK, "/api/v1/plan"])
def test_an_alias_bomb_is_refused_without_expanding_it(
    api: Any, nothing_written: None, path: str
) -> None:
    # 10^5 values, enough to pass the bound; the full billion-laughs document is below.
    response = post_yaml(api("alice"), laughs(5), path)
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "parse_error"
    assert body["line"] == 6
    assert body["detail"] == (
        "The definition is not valid YAML: the YAML was refused on line 6: through its anchors "
        "and aliases it expands to more than 100,000 values or 4,194,304 characters; write the "
        "repeated parts out, or repeat less."
    )


def test_a_billion_laughs_is_refused(api: Any, nothing_written: None) -> None:
    response = post_yaml(api("alice"), laughs(9))
    assert response.status_code == 400
    assert "expands to more than 100,000 values" in response.json()["detail"]


def test_an_alias_inside_its_own_value_is_refused(api: Any, nothing_written: None) -> None:
    response = post_yaml(api("alice"), "name: &a [x, *a]\n")
    assert response.status_code == 400
    assert "a recursive alias" in response.json()["detail"]


def test_a_few_aliases_are_fine(api: Any) -> None:
    text = (
        "name: aliased\n"
        "source: http://127.0.0.1:8000/mirror/acme/a/0123abc/a.gguf\n"
        "profiles:\n"
        "  - &cpu {name: cpu, memory_gb: 1, cores: 1}\n"
        "  - {<<: *cpu, name: bigger, memory_gb: 2}\n"
    )
    response = post_yaml(api("alice"), text)
    assert response.status_code == 201, response.json()
    assert [p["name"] for p in Model.objects.get().profiles] == ["cpu", "bigger"]


def test_a_key_given_twice_is_refused_with_both_lines(api: Any, nothing_written: None) -> None:
    text = yaml.safe_dump(definition(name="first"), sort_keys=False) + "name: second\n"
    response = post_yaml(api("alice"), text)
    assert response.status_code == 400
    body = response.json()
    assert body["line"] == len(text.splitlines())
    assert (
        f"the key 'name' is given twice in one mapping (lines 1 and {body['line']}); keep one of them"
        in body["detail"]
    )


def test_a_json_key_given_twice_is_refused(api: Any, nothing_written: None) -> None:
    text = json.dumps(definition(name="first"))[:-1] + ', "name": "second"}'
    response = post_json(api("alice"), text)
    assert response.status_code == 400
    assert response.json()["detail"] == (
        "The JSON body was refused: the key 'name' is given twice in one object; keep one of them."
    )


@pytest.mark.parametrize("post, content", [(post_yaml, "yaml"), (post_json, "json")])
def test_a_body_over_the_limit_is_refused_before_it_is_parsed(
    api: Any, nothing_written: None, post: Any, content: str
) -> None:
    padding = "x" * (2 * 1024 * 1024)
    text = f"name: x\ndescription: {padding}\n" if content == "yaml" else json.dumps({"d": padding})
    response = post(api("alice"), text)
    assert response.status_code == 413
    assert response.json() == {
        "detail": "The request body is too large; a model definition is a few kilobytes.",
        "code": "too_large",
    }


def test_a_huge_integer_in_yaml_is_refused(api: Any, nothing_written: None) -> None:
    text = yaml.safe_dump(definition(), sort_keys=False).replace(
        "min_replicas: 1", "min_replicas: " + "9" * 5000
    )
    response = post_yaml(api("alice"), text)
    assert response.status_code == 400
    assert (
        "a number with 5000 digits is larger than any field takes (at most 40)"
        in (response.json()["detail"])
    )


@pytest.mark.parametrize("digits", [5000, 4000, 400])
def test_a_huge_integer_in_json_is_refused(api: Any, nothing_written: None, digits: int) -> None:
    # 4,000 digits is within Python's conversion limit, and float() of it overflows.
    text = json.dumps(definition()).replace('"memory_gb": 1', '"memory_gb": ' + "9" * digits)
    response = post_json(api("alice"), text)
    assert response.status_code == 400
    assert response.json()["detail"] == (
        f"The JSON body was refused: a number with {digits} digits is larger than any field "
        "takes (at most 40)."
    )


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deep_yaml_is_refused(api: Any, nothing_written: None, depth: int) -> None:
    response = post_yaml(api("alice"), deep_yaml(depth))
    assert response.status_code == 400
    assert (
        "it is nested more than 32 levels deep; a definition needs four"
        in (response.json()["detail"])
    )


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deep_json_is_refused(api: Any, nothing_written: None, depth: int) -> None:
    response = post_json(api("alice"), deep_json(depth))
    assert response.status_code == 400
    assert "nested" in response.json()["detail"] and "deep" in response.json()["detail"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1.0e+999"])
def test_numbers_that_are_not_finite_are_refused_in_yaml(
    api: Any, nothing_written: None, value: str
) -> None:
    text = yaml.safe_dump(definition(), sort_keys=False).replace(
        "memory_gb: 1", f"memory_gb: {value}"
    )
    response = post_yaml(api("alice"), text)
    assert response.status_code == 400
    assert "is not a finite number" in response.json()["detail"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e999"])
def test_numbers_that_are_not_finite_are_refused_in_json(
    api: Any, nothing_written: None, value: str
) -> None:
    text = json.dumps(definition()).replace('"memory_gb": 1', f'"memory_gb": {value}')
    response = post_json(api("alice"), text)
    assert response.status_code == 400
    assert response.json()["detail"].startswith("The JSON body was refused: ")


def test_a_body_that_is_not_utf8_is_refused(api: Any, nothing_written: None) -> None:
    response = api("alice").post(NO_CHECK, b"name: \xff\xfe", content_type="application/yaml")
    assert response.status_code == 400
    assert "not UTF-8" in response.json()["detail"]


@pytest.mark.parametrize("post", [post_yaml, post_json])
def test_a_lone_surrogate_escape_is_refused(api: Any, nothing_written: None, post: Any) -> None:
    text = json.dumps(definition()).replace('"a tiny test model"', '"broken \\ud800 text"')
    response = post(api("alice"), text)
    assert response.status_code == 400
    assert (
        "it has a lone surrogate escape (like \\ud800), which is not a character"
        in (response.json()["detail"])
    )


def test_an_escaped_surrogate_pair_is_its_character(api: Any) -> None:
    text = json.dumps(definition(description="a model \U0001f600"))  # escaped as a pair
    assert "\\ud83d\\ude00" in text
    response = post_yaml(api("alice"), text)
    assert response.status_code == 201, response.json()
    assert Model.objects.get().description == "a model \U0001f600"

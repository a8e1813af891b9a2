"""The definition schema on its own: types, ranges, names, unknown fields, durations."""

from __future__ import annotations

import pytest

from catalog.definitions import clean_definition
from core.durations import DurationError, format_duration, parse_duration
from core.refusals import Refused
from core.yamltext import load_with_lines
from tests.factories import definition


def refusal(data: object, lines: dict | None = None) -> Refused:
    with pytest.raises(Refused) as caught:
        clean_definition(data, lines=lines)
    return caught.value


def test_it_accepts_the_documented_example_and_fills_defaults() -> None:
    clean = clean_definition(definition())
    assert clean["min_replicas"] == 1
    assert clean["max_replicas"] is None
    assert clean["class"] == ""
    assert clean["profiles"] == [
        {"name": "cpu", "memory_gb": 1, "cores": 1, "gpus": 0, "gpu_memory_gb": 0}
    ]
    assert clean["adapters"] == []


def test_it_refuses_unknown_fields_by_name_with_a_suggestion() -> None:
    error = refusal(definition(min_replica=2))
    assert error.problems[0].field == "min_replica"
    assert "unknown field; did you mean 'min_replicas'?" in error.problems[0].message


def test_it_refuses_unknown_fields_in_profiles_and_adapters() -> None:
    error = refusal(definition(profiles=[{"name": "cpu", "memory_gb": 1, "memroy": 2}]))
    assert error.problems[0].field == "profiles[0].memroy"


@pytest.mark.parametrize(
    "name, message",
    [
        ("has space", "has characters a name cannot have"),
        ("x" * 101, "at most 100 characters"),
        ("bad/slash", "has characters a name cannot have"),
    ],
)
def test_it_refuses_bad_names(name: str, message: str) -> None:
    assert message in refusal(definition(name=name)).message


def test_names_may_hold_dots_colons_dashes_and_underscores() -> None:
    assert (
        clean_definition(definition(name="qwen2.5:0.5b_instruct-q4"))["name"]
        == "qwen2.5:0.5b_instruct-q4"
    )


@pytest.mark.parametrize(
    "overrides, field, message",
    [
        ({"min_replicas": -1}, "min_replicas", "must not be negative"),
        ({"min_replicas": 5000}, "min_replicas", "at most 1000 replicas"),
        ({"min_replicas": "two"}, "min_replicas", "must be a whole number"),
        (
            {"profiles": [{"name": "cpu", "memory_gb": 1, "cores": False}]},
            "profiles[0].cores",
            "must be a number",
        ),
        (
            {"profiles": [{"name": "cpu", "memory_gb": -2}]},
            "profiles[0].memory_gb",
            "must not be negative",
        ),
        (
            {"profiles": [{"name": "cpu", "memory_gb": 1e9}]},
            "profiles[0].memory_gb",
            "not a real machine",
        ),
        ({"profiles": []}, "profiles", "may not be empty"),
        ({"class": "vip"}, "class", "is not a class"),
        ({"source": "ftp://x/y.gguf"}, "source", "is not an http(s) URL"),
        ({"idle_timeout": "soon"}, "idle_timeout", "is not a duration"),
        ({"idle_timeout": 900}, "idle_timeout", "with its unit"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas", "is below min_replicas"),
        ({"fallbacks": ["tiny-chat"]}, "fallbacks", "cannot fall back to itself"),
        (
            {"adapters": [{"name": "a", "source": "http://h/a.gguf", "scale": 50}]},
            "adapters[0].scale",
            "above 10",
        ),
        ({"sha256": "abc"}, "sha256", "64 lowercase hexadecimal"),
    ],
)
def test_it_refuses_bad_figures_with_a_clear_message(
    overrides: dict, field: str, message: str
) -> None:
    error = refusal(definition(**overrides))
    assert any(p.field == field and message in p.message for p in error.problems), error.problems
    assert error.message.startswith("The definition was refused, nothing was changed:")


def test_a_definition_that_is_not_a_mapping_is_refused() -> None:
    assert "must be a mapping" in refusal(["name", "x"]).message


def test_problems_carry_the_yaml_line() -> None:
    text = "name: tiny\nsource: http://127.0.0.1:8000/m.gguf\nprofiles:\n  - name: cpu\n    memory_gb: -1\n"
    data, lines = load_with_lines(text)
    error = refusal(data, lines)
    assert error.problems[0].line == 5
    assert "line 5: profiles[0].memory_gb: must not be negative" in error.message


@pytest.mark.parametrize(
    "text, seconds",
    [("15m", 900), ("6h", 21600), ("1h30m", 5400), ("0", 0), ("45s", 45), ("2d", 172800)],
)
def test_durations_round_trip(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["15", "m", "-5m", "1.5h", "999999d", True, None])
def test_bad_durations_are_refused(text: object) -> None:
    with pytest.raises(DurationError):
        parse_duration(text)


def test_a_profile_says_how_many_requests_a_replica_serves_at_once() -> None:
    clean = clean_definition(definition(profiles=[{"name": "cpu", "memory_gb": 4, "slots": 8}]))
    assert clean["profiles"][0]["slots"] == 8
    for slots, message in [
        (0, "a replica serves at least 1 request at a time"),
        (257, "at most 256 slots"),
    ]:
        error = refusal(definition(profiles=[{"name": "cpu", "memory_gb": 4, "slots": slots}]))
        assert (error.problems[0].field, error.problems[0].message) == (
            "profiles[0].slots",
            message,
        )


@pytest.mark.parametrize("name", [".", "..", "...", ".hidden", "-x", "_x", ":x"])
def test_names_that_urls_or_command_lines_would_misread_are_refused(name: str) -> None:
    error = refusal(definition(name=name))
    assert error.problems[0].field == "name"
    assert error.problems[0].message == (
        f"{name!r} cannot be a name: a name starts with a letter or a digit, because it is part "
        "of URLs such as /api/v1/models/NAME (where '.' and '..' mean something else) and of "
        "llmgw ctl commands (where '-' starts an option)"
    )


def test_a_dotted_name_inside_is_fine() -> None:
    clean_definition(definition(name="qwen2.5-0.5b"))


def test_a_gpu_profile_says_how_many_layers_it_offloads() -> None:
    gpu = {"name": "gpu", "memory_gb": 4, "gpus": 1, "gpu_memory_gb": 8}
    # Left out, it stays out (a definition reads back as written): every layer is the default.
    assert "gpu_layers" not in clean_definition(definition(profiles=[gpu]))["profiles"][0]
    for layers in ["all", 0, 20, 10000]:
        clean = clean_definition(definition(profiles=[{**gpu, "gpu_layers": layers}]))
        assert clean["profiles"][0]["gpu_layers"] == layers


@pytest.mark.parametrize("layers", [-1, 10001, "most", "12", 12.5, True, None, [1]])
def test_gpu_layers_other_than_all_or_a_count_are_refused(layers: object) -> None:
    gpu = {"name": "gpu", "memory_gb": 4, "gpus": 1, "gpu_layers": layers}
    error = refusal(definition(profiles=[gpu]))
    assert (error.problems[0].field, error.problems[0].message) == (
        "profiles[0].gpu_layers",
        'must be "all" (every layer on the GPUs, the default) or a whole number of layers from 0 '
        "to 10000",
    )


def test_gpu_layers_on_a_profile_without_gpus_is_refused() -> None:
    error = refusal(definition(profiles=[{"name": "cpu", "memory_gb": 4, "gpu_layers": 10}]))
    assert (error.problems[0].field, error.problems[0].message) == (
        "profiles[0].gpu_layers",
        "offloads layers to the profile's GPUs, and it has gpus 0: set gpus, or leave gpu_layers "
        "out",
    )

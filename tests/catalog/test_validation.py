"""Whole-catalog checks: names unique across models and adapters, fallbacks exist and do not loop."""

from __future__ import annotations

from catalog.validation import catalog_problems


def model(fallbacks: list[str] | None = None, adapters: list[str] | None = None) -> dict:
    return {"fallbacks": fallbacks or [], "adapters": [{"name": a} for a in adapters or []]}


def test_a_sound_catalog_has_no_problems() -> None:
    assert catalog_problems({"a": model(["b"]), "b": model(adapters=["b-sql"])}) == []


def test_an_adapter_may_not_take_a_models_name() -> None:
    problems = catalog_problems({"a": model(), "b": model(adapters=["a"])})
    assert [p.message for p in problems] == [
        "'a' is already the name of model a; adapters are asked for by name like models, so every name must be unique"
    ]


def test_two_models_may_not_have_adapters_of_one_name() -> None:
    problems = catalog_problems({"a": model(adapters=["sql"]), "b": model(adapters=["sql"])})
    assert "already the name of an adapter of model a" in problems[0].message


def test_a_fallback_must_exist() -> None:
    problems = catalog_problems({"a": model(["ghost"])})
    assert problems[0].field == "a.fallbacks[0]"
    assert "there is no model named 'ghost'" in problems[0].message


def test_fallback_loops_are_found_and_named() -> None:
    problems = catalog_problems({"a": model(["b"]), "b": model(["c"]), "c": model(["a"])})
    assert [p.message for p in problems] == [
        "the fallbacks form a loop (a -> b -> c -> a); break it"
    ]


def test_only_problems_of_the_changed_models_are_reported() -> None:
    catalog = {"old": model(["ghost"]), "new": model()}
    assert catalog_problems(catalog, changed=["new"]) == []
    assert len(catalog_problems(catalog, changed=["old"])) == 1


def test_a_long_fallback_chain_is_checked_quickly() -> None:
    catalog = {f"m{i:05d}": model([f"m{i + 1:05d}"] if i < 9999 else []) for i in range(10000)}
    assert catalog_problems(catalog) == []

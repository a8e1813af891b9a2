"""Checks of the whole would-be catalog, run before any change is written.

Each definition has already passed `catalog.definitions`; what is checked here
needs the other models: names unique across models *and* adapters (an adapter
is asked for by its name as though it were a model), fallbacks that exist and
do not loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from core.refusals import Problem


def catalog_problems(
    definitions: Mapping[str, Mapping[str, Any]], *, changed: Iterable[str] | None = None
) -> list[Problem]:
    """Problems in the catalog made of `definitions` (name -> definition).

    With `changed`, only the problems that involve those models are reported:
    an unrelated old problem must not block someone else's change.
    """
    problems: list[Problem] = []
    owners: dict[str, str] = {}  # a served name -> what holds it, in words
    for name in sorted(definitions):
        owners.setdefault(name, f"model {name}")
    for name in sorted(definitions):
        for index, adapter in enumerate(definitions[name].get("adapters", [])):
            adapter_name = adapter["name"]
            if adapter_name in owners:
                problems.append(
                    Problem(
                        f"{name}.adapters[{index}].name",
                        f"{adapter_name!r} is already the name of {owners[adapter_name]}; "
                        "adapters are asked for by name like models, so every name must be unique",
                    )
                )
            else:
                owners[adapter_name] = f"an adapter of model {name}"

    for name in sorted(definitions):
        fallbacks = definitions[name].get("fallbacks", [])
        for index, target in enumerate(fallbacks):
            if target == name:
                problems.append(
                    Problem(f"{name}.fallbacks[{index}]", "a model cannot fall back to itself")
                )
            elif target not in definitions:
                problems.append(
                    Problem(
                        f"{name}.fallbacks[{index}]",
                        f"there is no model named {target!r} to fall back to; add it first",
                    )
                )

    for loop in _fallback_loops(definitions):
        problems.append(
            Problem(
                f"{loop[0]}.fallbacks",
                f"the fallbacks form a loop ({' -> '.join([*loop, loop[0]])}); break it",
            )
        )

    if changed is not None:
        wanted = set(changed)
        problems = [p for p in problems if _mentions(p, wanted)]
    return problems


def _mentions(problem: Problem, names: set[str]) -> bool:
    subject = problem.field.split(".", 1)[0]
    if subject in names:
        return True
    return any(
        repr(name) in problem.message or f" {name} " in f" {problem.message} " for name in names
    )


def _fallback_loops(definitions: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The fallback cycles found by one depth-first walk (each back edge is one loop)."""
    loops: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in sorted(definitions):
        if root in state:
            continue
        path: list[str] = [root]
        state[root] = 1
        iterators = [iter(definitions[root].get("fallbacks", []))]
        while iterators:
            target = next(iterators[-1], None)
            if target is None:
                state[path.pop()] = 2
                iterators.pop()
                continue
            if target not in definitions or target == path[-1]:
                continue  # reported as a missing fallback or a fallback to itself
            if state.get(target) == 1:
                loop = path[path.index(target) :]
                smallest = loop.index(min(loop))
                loops.append(loop[smallest:] + loop[:smallest])
            elif target not in state:
                state[target] = 1
                path.append(target)
                iterators.append(iter(definitions[target].get("fallbacks", [])))
    return loops

"""The project's import graph, read with `ast` (imports inside functions count too).

A function-level import runs only when the function does, so it does not fail at import time
the way a module-level circle does; it still ties the two modules together, and it is how a
circle hides. Every import is counted here, wherever it sits.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a `from .x import y`, relative to `module`."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def imports_of(root: Path, path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (names not in `known` are left out)."""
    module = module_name(root, path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            # `from package import module` imports the module; `from module import name` the module.
            names = [f"{base}.{alias.name}" for alias in node.names]
            names = [n for n in names if n in known] or [base]
        else:
            continue
        for name in names:
            # `import a.b.c` imports a.b.c (and runs a, a.b): the deepest project module counts.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    files = {
        module_name(root, path): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    known = set(files)
    return {module: imports_of(root, path, known) for module, path in files.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


@dataclass(frozen=True)
class UpwardImport:
    importer: str
    imported: str

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported}, a higher layer"


def upward_imports(graph: Mapping[str, set[str]], layers: Mapping[str, int]) -> list[UpwardImport]:
    """Imports of a module whose top package sits in a higher layer than the importer's."""

    def layer(module: str) -> int | None:
        return layers.get(module.partition(".")[0])

    found = []
    for importer, imported in graph.items():
        mine = layer(importer)
        for name in sorted(imported):
            theirs = layer(name)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(UpwardImport(importer, name))
    return sorted(found, key=str)

"""YAML read with the line each value came from, so that errors can point at it."""

from __future__ import annotations

from typing import Any

import yaml


class YAMLSyntaxError(ValueError):
    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.line = line


Path = tuple[str | int, ...]


def load_with_lines(text: str) -> tuple[Any, dict[Path, int]]:
    """Parse YAML text; return the data and a map from each value's path to its 1-based line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "it is not valid YAML"
        where = f" on line {line}" if line else ""
        raise YAMLSyntaxError(f"the YAML could not be read{where}: {problem}", line) from None
    except yaml.YAMLError as exc:
        raise YAMLSyntaxError(f"the YAML could not be read: {exc}", None) from None
    lines: dict[Path, int] = {}
    if node is not None:
        _walk(node, (), lines)
    return data, lines


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int]) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            _walk(value_node, (*path, key), lines)
            # The key's own line is the better pointer for "unknown field".
            lines[(*path, key)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines)


def line_for(lines: dict[Path, int], path: Path) -> int | None:
    """The line of the deepest known part of path."""
    for end in range(len(path), -1, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None

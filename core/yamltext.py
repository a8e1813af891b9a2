"""YAML read with the line each value came from, so that errors can point at it.

Every YAML the control plane reads (API bodies, console Add, the admin, plan, server.yaml) comes
through `load_with_lines`, which reads it within bounds, because a few hundred bytes of YAML can
otherwise take a worker down. The JSON parser applies the same bounds through `check_document`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

# A model definition is a few dozen values nested four deep; server.yaml with
# hundreds of models a few thousand. These bounds are far above both.
MAX_VALUES = 100_000
MAX_CHARACTERS = 4 * 1024 * 1024
MAX_DEPTH = 32
MAX_DIGITS = 40


class YAMLSyntaxError(ValueError):
    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.line = line


class DocumentRefused(ValueError):
    """A parsed document (YAML or JSON) beyond the bounds above; the message says which."""


Path = tuple[str | int, ...]


def _line(mark: Any) -> int | None:
    return mark.line + 1 if mark is not None else None


class _Refused(Exception):
    def __init__(self, message: str, mark: Any) -> None:
        super().__init__(message)
        self.message = message
        self.line = _line(mark)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode(text: str, mark: Any = None) -> str:
    """`text` with escaped surrogate pairs joined; a lone surrogate is refused."""
    if not _SURROGATE.search(text):
        return text
    try:
        return text.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        raise _Refused(
            "it has a lone surrogate escape (like \\ud800), which is not a character", mark
        ) from None


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the bounds of this module checked while it composes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        # id(node) -> (values, characters) the node expands to, once it is complete.
        self._sizes: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise _Refused(
                    "an alias refers to the value it is inside of (a recursive alias); "
                    "write the value out instead",
                    mark,
                )
            return node
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(
                f"it is nested more than {MAX_DEPTH} levels deep; a definition needs four", mark
            )
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        assert node is not None  # only an alias to nothing composes to None, and that raises
        self._measure(node, mark)
        return node

    def _measure(self, node: yaml.Node, mark: Any) -> None:
        if isinstance(node, yaml.ScalarNode):
            node.value = _unicode(node.value, mark)
            size = (1, len(node.value))
            if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_DIGITS:
                raise _Refused(
                    f"a number with {len(node.value)} digits is larger than any field takes "
                    f"(at most {MAX_DIGITS})",
                    mark,
                )
        elif isinstance(node, yaml.SequenceNode):
            size = self._total(node.value)
        else:
            assert isinstance(node, yaml.MappingNode)
            self._refuse_duplicate_keys(node)
            size = self._total([part for pair in node.value for part in pair])
        values, characters = size
        if values > MAX_VALUES or characters > MAX_CHARACTERS:
            raise _Refused(
                f"through its anchors and aliases it expands to more than {MAX_VALUES:,} values "
                f"or {MAX_CHARACTERS:,} characters; write the repeated parts out, or repeat less",
                mark,
            )
        self._sizes[id(node)] = size

    def _total(self, children: list[yaml.Node]) -> tuple[int, int]:
        values, characters = 1, 0
        for child in children:
            child_values, child_characters = self._sizes[id(child)]
            values += child_values
            characters += child_characters
        return values, characters

    def _refuse_duplicate_keys(self, node: yaml.MappingNode) -> None:
        seen: dict[tuple[str, str], int | None] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = (key_node.tag, key_node.value)
            line = _line(key_node.start_mark)
            if key in seen:
                raise _Refused(
                    f"the key {key_node.value!r} is given twice in one mapping (lines {seen[key]} "
                    f"and {line}); keep one of them",
                    key_node.start_mark,
                )
            seen[key] = line

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise ConstructorError(
                None, None, f"{node.value!r} is not a finite number", node.start_mark
            )
        return value


_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _BoundedLoader.construct_yaml_float)


def load_with_lines(text: str) -> tuple[Any, dict[Path, int]]:
    """Parse YAML text; return the data and a map from each value's path to its 1-based line.

    Refused, each with a YAMLSyntaxError naming the line: aliases that expand past MAX_VALUES
    values or MAX_CHARACTERS characters ("billion laughs"), or refer to the value they are
    inside of; nesting deeper than MAX_DEPTH (PyYAML's composer recurses); an integer of more
    than MAX_DIGITS characters, a float that is not finite; a key given twice in one mapping
    (PyYAML would keep the last silently); a lone surrogate (an escaped pair is joined)."""
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text)
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except _Refused as exc:
        where = f" on line {exc.line}" if exc.line else ""
        raise YAMLSyntaxError(f"the YAML was refused{where}: {exc.message}", exc.line) from None
    except yaml.reader.ReaderError as exc:
        character_line = text.count("\n", 0, exc.position) + 1
        raise YAMLSyntaxError(
            f"the YAML could not be read on line {character_line}: character "
            f"{exc.character!r} is not allowed in YAML",
            character_line,
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = _line(mark)
        problem = exc.problem or exc.context or "it is not valid YAML"
        where = f" on line {line}" if line else ""
        raise YAMLSyntaxError(f"the YAML could not be read{where}: {problem}", line) from None
    except yaml.YAMLError as exc:
        raise YAMLSyntaxError(f"the YAML could not be read: {exc}", None) from None
    finally:
        if loader is not None:
            loader.dispose()
    lines: dict[Path, int] = {}
    if node is not None:
        _walk(node, lines)
    return data, lines


def _walk(root: yaml.Node, lines: dict[Path, int]) -> None:
    """Each path's line; iterative, and bounded by the loader's MAX_VALUES and MAX_DEPTH."""
    stack: list[tuple[yaml.Node, Path]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
                # The key's own line is the better pointer for "unknown field".
                lines[(*path, key)] = key_node.start_mark.line + 1
                stack.append((value_node, (*path, key)))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                stack.append((item, (*path, index)))


def check_document(data: Any) -> None:
    """The bounds above, for a document parsed from JSON; DocumentRefused says which is passed."""
    values = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        values += 1
        if values > MAX_VALUES:
            raise DocumentRefused(f"it has more than {MAX_VALUES:,} values")
        if depth > MAX_DEPTH:
            raise DocumentRefused(
                f"it is nested more than {MAX_DEPTH} levels deep; a definition needs four"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise DocumentRefused(f"{value!r} is not a finite number")
        if isinstance(value, str) and _SURROGATE.search(value):
            raise DocumentRefused(
                "it has a lone surrogate escape (like \\ud800), which is not a character"
            )
        if isinstance(value, dict):
            stack.extend((key, depth + 1) for key in value)
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def line_for(lines: dict[Path, int], path: Path) -> int | None:
    """The line of the deepest known part of path."""
    for end in range(len(path), -1, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None

"""YAML configs: positions of every key, duplicate keys as errors, numbers kept as written.

PyYAML silently keeps the last of two duplicate keys and forgets where anything was, so the
document is composed into nodes (which carry their marks) and built here. Plain scalars that
read as numbers -- including YAML 1.1's `5e8`, which PyYAML leaves as the string "5e8" --
become `YamlNumber`: the schema turns them into numbers where it expects a number and keeps
the text where it expects a string (environment values).
"""

from __future__ import annotations

from typing import Any

import yaml
import yaml.constructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from zerorun.config.jsonc import Locations, Path_
from zerorun.config.types import YamlNumber, number_from_text

__all__ = ["YamlConfigError", "parse_yaml"]

_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlConfigError(ValueError):
    def __init__(self, message: str, line: int | None, column: int | None) -> None:
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(f"{message}{where}")
        self.message = message
        self.line = line
        self.column = column


def _mark(node: Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


class _Builder:
    def __init__(self) -> None:
        self.constructor = yaml.constructor.SafeConstructor()
        self.locations: Locations = {}

    def build(self, node: Node, path: Path_) -> Any:
        if isinstance(node, MappingNode):
            return self.mapping(node, path)
        if isinstance(node, SequenceNode):
            out = []
            for i, item in enumerate(node.value):
                self.locations[(*path, i)] = _mark(item)
                out.append(self.build(item, (*path, i)))
            return out
        assert isinstance(node, ScalarNode)
        return self.scalar(node)

    def scalar(self, node: ScalarNode) -> Any:
        if node.style is None and node.tag in (_INT_TAG, _FLOAT_TAG, _STR_TAG):
            # Plain (unquoted) scalar: `5e8` resolves to str in YAML 1.1; keep text + number.
            value = self.constructor.construct_object(node, deep=True)
            if node.tag == _STR_TAG:
                number = number_from_text(node.value)
                return value if number is None else YamlNumber(node.value, number)
            return YamlNumber(node.value, value)
        return self.constructor.construct_object(node, deep=True)

    def mapping(self, node: MappingNode, path: Path_) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        explicit: dict[str, tuple[int, int]] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *defaults`
                sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
                for source in sources:
                    merged = self.build(source, path)
                    if not isinstance(merged, dict):
                        raise YamlConfigError("'<<' must merge a mapping", *_mark(source))
                    for k, v in merged.items():
                        if k not in explicit:
                            result.setdefault(k, v)
                continue
            key = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            if isinstance(key, YamlNumber):
                key = str(key)
            if not isinstance(key, str):
                raise YamlConfigError(f"keys must be names, found {key_node.value!r}", *_mark(key_node))
            here = _mark(key_node)
            if key in explicit:
                first = explicit[key]
                dotted = ".".join(str(p) for p in (*path, key))
                raise YamlConfigError(f"duplicate key {dotted!r} (first given at line {first[0]})", *here)
            explicit[key] = here
            self.locations[(*path, key)] = here
            result[key] = self.build(value_node, (*path, key))
        return result


def parse_yaml(text: str) -> tuple[Any, Locations]:
    """Parse one YAML document -> (value, {path: (line, column)}); raises YamlConfigError."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "invalid YAML"
        if mark is None:
            raise YamlConfigError(f"invalid YAML: {problem}", None, None) from None
        raise YamlConfigError(f"invalid YAML: {problem}", mark.line + 1, mark.column + 1) from None
    except yaml.YAMLError as err:
        raise YamlConfigError(f"invalid YAML: {err}", None, None) from None
    if node is None:
        raise YamlConfigError("the file is empty (expected a mapping of config keys)", None, None)
    builder = _Builder()
    try:
        value = builder.build(node, ())
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark
        raise YamlConfigError(
            f"invalid YAML value: {err.problem}", *((mark.line + 1, mark.column + 1) if mark else (None, None))
        ) from None
    return value, builder.locations

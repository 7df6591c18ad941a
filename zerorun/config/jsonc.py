"""DeepSpeed-flavoured JSON: `//`, `/* */` and `#` comments, trailing commas, positions.

DeepSpeed reads its config with hjson, so real ds_config.json files carry comments (the
article's stage-2 config has `"device": "none", // ...`) and trailing commas. The standard
`json` module accepts neither and cannot tell where a key was, so this is a small
recursive-descent parser that records the line and column of every key: error messages point
at the line the user has to edit, and duplicate keys are reported with both lines.
"""

from __future__ import annotations

import bisect
import json.decoder
import re
from typing import Any

__all__ = ["JsoncError", "parse_jsonc", "Path_", "Locations"]

Path_ = tuple[str | int, ...]
Locations = dict[Path_, tuple[int, int]]

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}


class JsoncError(ValueError):
    """A syntax error with its 1-based line and column."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(f"{message} (line {line}, column {column})")
        self.message = message
        self.line = line
        self.column = column


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.line_starts = [0] + [m.end() for m in re.finditer(r"\n", text)]
        self.locations: Locations = {}

    # -- positions -----------------------------------------------------------------------
    def where(self, pos: int) -> tuple[int, int]:
        line = bisect.bisect_right(self.line_starts, pos) - 1
        return line + 1, pos - self.line_starts[line] + 1

    def fail(self, message: str, pos: int | None = None) -> JsoncError:
        line, column = self.where(self.pos if pos is None else pos)
        return JsoncError(message, line, column)

    # -- lexing --------------------------------------------------------------------------
    def skip(self) -> None:
        """Skip whitespace and comments."""
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c in " \t\r\n\ufeff":
                self.pos += 1
            elif c == "#" or text.startswith("//", self.pos):
                end = text.find("\n", self.pos)
                self.pos = n if end < 0 else end + 1
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                if end < 0:
                    raise self.fail("unterminated /* comment")
                self.pos = end + 2
            else:
                return

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def describe_here(self) -> str:
        c = self.peek()
        return "the end of the file" if not c else repr(c)

    # -- grammar -------------------------------------------------------------------------
    def document(self) -> Any:
        self.skip()
        if not self.peek():
            raise self.fail("the file is empty (expected a JSON object)")
        value = self.value(())
        self.skip()
        if self.peek():
            raise self.fail(f"unexpected {self.describe_here()} after the end of the top-level value")
        return value

    def value(self, path: Path_) -> Any:
        c = self.peek()
        if c == "{":
            return self.object(path)
        if c == "[":
            return self.array(path)
        if c == '"':
            return self.string()
        m = _NUMBER.match(self.text, self.pos)
        if m and m.end() > self.pos:
            self.pos = m.end()
            return float(m.group()) if (m.group(1) or m.group(2)) else int(m.group())
        for word, literal in _LITERALS.items():
            if self.text.startswith(word, self.pos):
                self.pos += len(word)
                return literal
        if c == "'":
            raise self.fail("strings must use double quotes (\") in JSON")
        if self.text.startswith(("True", "False", "None"), self.pos):
            raise self.fail("JSON spells these true, false and null (lower case)")
        raise self.fail(f"expected a value, found {self.describe_here()}")

    def string(self) -> str:
        start = self.pos
        try:
            value, end = json.decoder.scanstring(self.text, self.pos + 1)  # type: ignore[attr-defined]
        except json.JSONDecodeError as err:
            raise self.fail(f"invalid string: {err.msg}", err.pos if err.pos >= start else start) from None
        self.pos = end
        return value

    def object(self, path: Path_) -> dict[str, Any]:
        self.pos += 1  # {
        result: dict[str, Any] = {}
        self.skip()
        if self.peek() == "}":
            self.pos += 1
            return result
        while True:
            if self.peek() != '"':
                if self.peek() == "}":  # trailing comma, as hjson allows
                    self.pos += 1
                    return result
                raise self.fail(f"expected a key in double quotes, found {self.describe_here()}")
            key_pos = self.pos
            key = self.string()
            here = self.where(key_pos)
            if key in result:
                first = self.locations.get((*path, key), ("?", "?"))
                dotted = ".".join(str(p) for p in (*path, key))
                raise JsoncError(f"duplicate key {dotted!r} (first given at line {first[0]})", *here)
            self.locations[(*path, key)] = here
            self.skip()
            if self.peek() != ":":
                raise self.fail(f"expected ':' after the key {key!r}, found {self.describe_here()}")
            self.pos += 1
            self.skip()
            result[key] = self.value((*path, key))
            self.skip()
            c = self.peek()
            if c == ",":
                self.pos += 1
                self.skip()
                continue
            if c == "}":
                self.pos += 1
                return result
            raise self.fail(f"expected ',' or '}}' after the value of {key!r}, found {self.describe_here()}")

    def array(self, path: Path_) -> list[Any]:
        self.pos += 1  # [
        result: list[Any] = []
        self.skip()
        if self.peek() == "]":
            self.pos += 1
            return result
        while True:
            if self.peek() == "]":  # trailing comma
                self.pos += 1
                return result
            self.locations[(*path, len(result))] = self.where(self.pos)
            result.append(self.value((*path, len(result))))
            self.skip()
            c = self.peek()
            if c == ",":
                self.pos += 1
                self.skip()
                continue
            if c == "]":
                self.pos += 1
                return result
            raise self.fail(f"expected ',' or ']' in a list, found {self.describe_here()}")


def parse_jsonc(text: str) -> tuple[Any, Locations]:
    """Parse JSON with comments and trailing commas -> (value, {path: (line, column)})."""
    parser = _Parser(text)
    value = parser.document()
    return value, parser.locations

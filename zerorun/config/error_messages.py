"""Turning pydantic's validation errors into messages that name the key, the value and the fix.

pydantic reports unions member by member (`train_batch_size.function-before[...]`,
`train_batch_size.literal['auto']`); users need one line per key: where it is, what they
wrote, what is allowed, and for an unknown key the key they probably meant.
"""

from __future__ import annotations

import difflib
import functools
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from zerorun.config.jsonc import Path_
from zerorun.config.reader import RawConfig, dotted

__all__ = ["format_validation_error", "schema_walk", "known_key_paths", "describe_type"]

_RANGE_ERRORS = {"greater_than_equal", "greater_than", "less_than_equal", "less_than"}
_SYMBOLS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def _members(tp: Any) -> list[Any]:
    """Flatten Annotated / Union / Optional into the member types."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        out: list[Any] = []
        for arg in get_args(tp):
            out.extend(_members(arg))
        return out
    return [tp]


def _model_of(tp: Any) -> type[BaseModel] | None:
    for member in _members(tp):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _bounds(metadata: Any) -> str:
    bounds = []
    for item in metadata:
        for attr in ("ge", "gt", "le", "lt"):
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{_SYMBOLS[attr]} {getattr(item, attr)}")
    return " " + " and ".join(bounds) if bounds else ""


def _top_members(tp: Any) -> list[Any]:
    """Union members, keeping each member's Annotated wrapper (its bounds)."""
    if get_origin(tp) is Union or get_origin(tp) is types.UnionType:
        out: list[Any] = []
        for arg in get_args(tp):
            out.extend(_top_members(arg))
        return out
    return [tp]


def describe_type(tp: Any) -> str:
    """A type as users read it: 'a whole number ≥ 1, "auto" or null'."""
    parts: list[str] = []
    for wrapped in _top_members(tp):
        bounds = ""
        member = wrapped
        if get_origin(wrapped) is Annotated:
            member, *metadata = get_args(wrapped)
            bounds = _bounds(metadata)
        origin = get_origin(member)
        if member is type(None):
            parts.append("null")
        elif member is bool:
            parts.append("true/false")
        elif member is int:
            parts.append("a whole number" + bounds)
        elif member is float:
            parts.append("a number" + bounds)
        elif member is str:
            parts.append("a string")
        elif origin is Literal:
            parts.append(" / ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in get_args(member)))
        elif origin is dict or member is dict:
            parts.append("a mapping")
        elif origin is list or member is list:
            parts.append("a list")
        elif isinstance(member, type) and issubclass(member, BaseModel):
            parts.append("a mapping (section)")
        else:
            parts.append(getattr(member, "__name__", str(member)))
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _constraints(info: FieldInfo | None) -> str:
    if info is None:
        return ""
    bounds = _bounds(info.metadata)
    return f" ({bounds.strip()})" if bounds else ""


def schema_walk(
    loc: tuple[Any, ...], root: type[BaseModel]
) -> tuple[Path_, FieldInfo | None, type[BaseModel] | None, Any]:
    """pydantic's loc -> (the user's key path, its FieldInfo, the model that holds it, its type)."""
    tp: Any = root
    info: FieldInfo | None = None
    holder: type[BaseModel] | None = None
    path: list[str | int] = []
    for part in loc:
        model = _model_of(tp)
        non_none = [m for m in _members(tp) if m is not type(None)]
        if model is not None and isinstance(part, str) and part in model.model_fields:
            holder, info = model, model.model_fields[part]
            tp = info.annotation
            path.append(part)
            continue
        if len(non_none) > 1 and isinstance(part, str) and model is None:
            continue  # a union member's tag, not a key the user wrote
        container = next((m for m in non_none if get_origin(m) in (dict, list)), None)
        if container is not None:
            args = get_args(container)
            tp = args[-1] if args else Any
            info = None
        else:
            tp = Any
            if model is not None:
                holder = model  # the section that lacks this key (an unknown key)
            info = None
        path.append(part)
    return tuple(path), info, holder, tp


@functools.cache
def known_key_paths(root: type[BaseModel]) -> dict[str, list[str]]:
    """key name -> every dotted path where the schema has that key (for 'it belongs in X')."""
    index: dict[str, list[str]] = {}

    def visit(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            full = f"{prefix}.{name}" if prefix else name
            index.setdefault(name, []).append(full)
            sub = _model_of(info.annotation)
            if sub is not None:
                visit(sub, full)

    visit(root, "")
    return index


def _unknown_key(raw: RawConfig, path: Path_, holder: type[BaseModel] | None, root: type[BaseModel]) -> str:
    key = str(path[-1])
    where = raw.where(path)
    section = dotted(path[:-1]) if len(path) > 1 else "the top level"
    known = list(holder.model_fields) if holder is not None else []
    hint = ""
    elsewhere = [p for p in known_key_paths(root).get(key, []) if p != dotted(path)]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        hint = f" Did you mean {close[0]!r}?"
    elif elsewhere:
        places = [p.rsplit(".", 1)[0] if "." in p else "the top level" for p in elsewhere]
        hint = f" {key!r} belongs in {' or '.join(places)} ({elsewhere[0]})."
    else:
        # A DeepSpeed key with a typo in another section, e.g. top-level `zero_optimisation`.
        everything = list(known_key_paths(root))
        far = difflib.get_close_matches(key, everything, n=1, cutoff=0.75)
        if far:
            hint = f" Did you mean {known_key_paths(root)[far[0]][0]!r}?"
    return f"{where}: unknown key in {section}.{hint}"


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return repr(str(value))
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _one_message(raw: RawConfig, path: Path_, errors: list[dict[str, Any]], info: FieldInfo | None, tp: Any) -> str:
    where = raw.where(path)
    value = errors[0].get("input")
    by_type = {e["type"]: e for e in errors}
    if "value_error" in by_type or "assertion_error" in by_type:
        e = by_type.get("value_error") or by_type["assertion_error"]
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        return f"{where}: {msg}"
    for kind in _RANGE_ERRORS:
        if kind in by_type:
            e = by_type[kind]
            ctx = e.get("ctx", {})
            (bound_name, bound), *_ = ctx.items()
            symbol = _SYMBOLS.get(bound_name, bound_name)
            return f"{where}: {_shown(e.get('input'))} is out of range; it must be {symbol} {bound}"
    if "missing" in by_type:
        return f"{where}: required key is missing"
    expected = describe_type(info.annotation if info is not None else tp) if tp is not Any else None
    if expected is None:
        e = errors[0]
        return f"{where}: {e['msg']} (got {_shown(value)})"
    return f"{where}: expected {expected}{_constraints(info)}, got {_shown(value)}"


def format_validation_error(raw: RawConfig, err: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per offending key, in the order the keys appear in the file."""
    grouped: dict[Path_, tuple[list[dict[str, Any]], FieldInfo | None, type[BaseModel] | None, Any]] = {}
    for e in err.errors():
        path, info, holder, tp = schema_walk(tuple(e["loc"]), root)
        entry = grouped.setdefault(path, ([], info, holder, tp))
        entry[0].append(dict(e))
    lines: list[tuple[tuple[int, int], str]] = []
    for path, (errors, info, holder, tp) in grouped.items():
        if any(e["type"] == "extra_forbidden" for e in errors):
            text = _unknown_key(raw, path, holder, root)
        else:
            text = _one_message(raw, path, errors, info, tp)
        lines.append((raw.locations.get(path, (10**9, 0)), text))
    return [text for _, text in sorted(lines, key=lambda item: item[0])]

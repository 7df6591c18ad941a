"""Value types of the config schema: sizes, reals, `"auto"`, YAML numbers, field metadata.

Numbers arrive in three shapes that users consider the same thing:

* JSON has no integer exponent form, so `"allgather_bucket_size": 5e8` is the float
  500000000.0; integer fields accept integral floats.
* PyYAML follows YAML 1.1, where `5e8` (no dot) is not a float but the *string* "5e8". The
  YAML reader therefore wraps every plain scalar that looks like a number in `YamlNumber`,
  a `str` that also carries its numeric value. Numeric fields take the value, string fields
  (an environment variable's value) keep the text exactly as written, and free-form
  dictionaries (`optimizer.params`) get the number.
* Booleans are never numbers: `true` in an integer field is an error, not 1.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BeforeValidator, Field, Strict

__all__ = [
    "AUTO",
    "Auto",
    "Count",
    "Flag",
    "Real",
    "PositiveCount",
    "SizeCount",
    "NonNegReal",
    "EnvValue",
    "YamlNumber",
    "plain_numbers",
    "meta",
    "field",
    "number_from_text",
]

AUTO = "auto"
Auto = Literal["auto"]

# What YAML 1.2 (and JSON) would call a number but YAML 1.1 leaves as a string: `5e8`, `1E-4`,
# `+3e2`. Also matches ordinary ints and floats, which the YAML reader wraps too.
NUMBER_TEXT = re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?(?:[eE][-+]?\d+)?$")


class YamlNumber(str):
    """A YAML plain scalar that reads as a number: the text as written, plus `.value`."""

    value: int | float

    def __new__(cls, text: str, value: int | float) -> YamlNumber:
        obj = super().__new__(cls, text)
        obj.value = value
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (YamlNumber, (str(self), self.value))


def number_from_text(text: str) -> int | float | None:
    """`"5e8"` -> 500000000, `"1e-4"` -> 0.0001, `"12"` -> 12; None when it is not a number."""
    t = text.strip().replace("_", "")
    if not t or not NUMBER_TEXT.match(t) or not any(c.isdigit() for c in t):
        return None
    try:
        if re.fullmatch(r"[-+]?\d+", t):
            return int(t)
        value = float(t)
    except ValueError:
        return None
    # A size written as 5e8 (no dot) is meant as an integer; `1.0` stays a float.
    if "." not in t and math.isfinite(value) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


def _numeric(value: Any) -> Any:
    """Unwrap YAML numbers and numeric strings; leave anything else for pydantic to judge."""
    if isinstance(value, YamlNumber):
        return value.value
    if isinstance(value, str) and value != AUTO:
        parsed = number_from_text(value)
        if parsed is not None:
            return parsed
    return value


def _to_count(value: Any) -> Any:
    value = _numeric(value)
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, got the boolean {str(value).lower()}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"expected a whole number, got {value!r}")
        return int(value)
    return value


def _to_real(value: Any) -> Any:
    value = _numeric(value)
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


def _to_env_value(value: Any) -> Any:
    # Environment values stay text: `NCCL_BUFFSIZE: 5e8` in YAML is the string "5e8", and a
    # JSON 8 becomes "8". Booleans become "true"/"false" (`TOKENIZERS_PARALLELISM: false`; YAML's
    # `no`/`off` too -- quote them to keep that spelling). null is not a value: unset means absent.
    if isinstance(value, YamlNumber):
        return str.__str__(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        raise ValueError("environment values are strings; write 'null' in quotes if you mean the text, or remove the key")
    if isinstance(value, int | float):
        return str(value)
    return value


# JSON/YAML booleans only: pydantic's lax mode would read "yes", "off" or 1 as booleans.
Flag = Annotated[bool, Strict()]
Count = Annotated[int, BeforeValidator(_to_count)]
Real = Annotated[float, BeforeValidator(_to_real)]
# Bounds inside the type, for unions with "auto" (a bound on the field would apply to "auto").
PositiveCount = Annotated[int, BeforeValidator(_to_count), annotated_types.Ge(1)]
SizeCount = Annotated[int, BeforeValidator(_to_count), annotated_types.Ge(0)]
NonNegReal = Annotated[float, BeforeValidator(_to_real), annotated_types.Ge(0)]
EnvValue = Annotated[str, BeforeValidator(_to_env_value)]


def plain_numbers(value: Any) -> Any:
    """Free-form data (optimizer params, sections zerorun passes through): YAML numbers -> numbers."""
    if isinstance(value, YamlNumber):
        return value.value
    if isinstance(value, dict):
        return {k: plain_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_numbers(v) for v in value]
    return value


_UNSET: Any = object()


def meta(
    description: str,
    *,
    stages: tuple[int, ...] | None = None,
    acted_on: bool = True,
    fixed: str | None = None,
    fixed_value: Any = _UNSET,
) -> dict[str, Any]:
    """Schema metadata for one key, read by the cross-field rules and the reference generator.

    `stages`: the ZeRO stages the key has an effect at (None: all). A key set explicitly at
    another stage gets a warning. `acted_on=False`: a DeepSpeed key zerorun accepts but does
    not implement; setting it to a non-default value gives a notice. `fixed`: what zerorun
    always does instead (implies acted_on=False); with `fixed_value`, only a value other than
    that one gives the notice (`overlap_comm: true` is what zerorun does anyway).
    """
    extra: dict[str, Any] = {"acted_on": acted_on and fixed is None}
    if stages is not None:
        extra["stages"] = list(stages)
    if fixed is not None:
        extra["fixed"] = fixed
        if fixed_value is not _UNSET:
            extra["fixed_value"] = fixed_value
    return {"description": description, "json_schema_extra": extra}


def field(default: Any = ..., description: str = "", **kwargs: Any) -> Any:
    """`pydantic.Field` with `meta(...)`: `field(5, "what it does", stages=(3,), ge=0)`."""
    meta_kwargs = {k: kwargs.pop(k) for k in ("stages", "acted_on", "fixed", "fixed_value") if k in kwargs}
    if "default_factory" in kwargs:
        return Field(**meta(description, **meta_kwargs), **kwargs)
    return Field(default, **meta(description, **meta_kwargs), **kwargs)


def field_meta(model: type[Any], name: str) -> dict[str, Any]:
    """The `meta(...)` of one key (``json_schema_extra``; {} for a key without one)."""
    extra = model.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


def shown(value: Any) -> str:
    """A value as a config message shows it: true/false, strings quoted, numbers as written."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)

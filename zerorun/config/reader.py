"""Reading a config source (a path or a dict) into plain data plus key positions."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from zerorun.config.jsonc import JsoncError, Locations, Path_, parse_jsonc
from zerorun.errors import ConfigError

__all__ = ["RawConfig", "read_source", "dotted"]

Format = Literal["json", "yaml", "dict"]


def dotted(path: Path_) -> str:
    """('zero_optimization', 'offload_param', 'device') -> 'zero_optimization.offload_param.device'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


@dataclass
class RawConfig:
    """The user's data before validation, and where each key was written."""

    data: dict[str, Any]
    path: Path | None
    format: Format
    locations: Locations = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.path) if self.path is not None else "config"

    def where(self, path: Path_) -> str:
        """'zero_optimization.stage (line 5)' -- the line when known, for messages."""
        loc = self.locations.get(tuple(path))
        return f"{dotted(path)} (line {loc[0]})" if loc else dotted(path)


def _guess_format(path: Path, text: str) -> Format:
    suffix = path.suffix.lower()
    if suffix == ".json":
        return "json"
    if suffix in (".yaml", ".yml"):
        return "yaml"
    # No telling suffix: DeepSpeed configs start with `{` (possibly after comments).
    stripped = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("//", "#")))
    return "json" if stripped.lstrip().startswith("{") else "yaml"


def read_source(source: str | Path | dict[str, Any]) -> RawConfig:
    """Read a config file (JSON with comments or YAML) or take a dict; raises ConfigError."""
    if isinstance(source, dict):
        return RawConfig(data=copy.deepcopy(source), path=None, format="dict")
    if not isinstance(source, str | Path):
        raise ConfigError(
            f"a config must be a file path or a dict, not {type(source).__name__}"
        )
    path = Path(source)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (check the path; it is relative to {Path.cwd()})") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied (the file is not readable by this user)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (invalid byte at line {line}); save the file as UTF-8") from None

    fmt = _guess_format(path, text)
    if fmt == "json":
        try:
            data, locations = parse_jsonc(text)
        except JsoncError as err:
            if err.message.startswith("duplicate key"):
                raise ConfigError(f"{path}: line {err.line}: {err.message}; keep one of them") from None
            raise ConfigError(f"{path}: invalid JSON at line {err.line}, column {err.column}: {err.message}") from None
    else:
        # PyYAML loads only for a YAML file: ranks parse the JSON the launcher gives them without it.
        from zerorun.config.yaml_reader import YamlConfigError, parse_yaml

        try:
            data, locations = parse_yaml(text)
        except YamlConfigError as err:
            if err.message.startswith("duplicate key"):
                raise ConfigError(f"{path}: line {err.line}: {err.message}; keep one of them") from None
            where = f" at line {err.line}, column {err.column}" if err.line is not None else ""
            raise ConfigError(f"{path}: invalid YAML{where}: {err.message.removeprefix('invalid YAML: ')}") from None
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a single value ({data!r})"
        raise ConfigError(
            f"{path}: the top level must be a mapping of config keys (like {{\"zero_optimization\": ...}}), "
            f"but it is {kind}"
        )
    return RawConfig(data=data, path=path, format=fmt, locations=locations)

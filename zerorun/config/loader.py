"""`load_config`: source -> validated `ZerorunConfig` + warnings + notices (Contract 1)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zerorun.config.aliases import rewrite_aliases
from zerorun.config.batch import BatchResolution, resolve_batch
from zerorun.config.error_messages import format_validation_error
from zerorun.config.reader import RawConfig, read_source
from zerorun.config.rules import check_rules, check_runtime_support, open_autos
from zerorun.config.schema import ZerorunConfig
from zerorun.errors import ConfigError, RuntimeConfigError

__all__ = ["LoadedConfig", "load_config", "UnsupportedByRuntime"]


class UnsupportedByRuntime(ConfigError, RuntimeConfigError):
    """Valid DeepSpeed naming something zerorun's runtime does not build (an optimizer, a
    scheduler, a keyword): a config error to the launcher and print-config, and the
    RuntimeConfigError zerorun.initialize is documented to raise."""


@dataclass
class LoadedConfig:
    """A validated config and what the user should know about it."""

    config: ZerorunConfig
    warnings: list[str] = field(default_factory=list)  # no effect where written, or deprecated
    notices: list[str] = field(default_factory=list)  # DeepSpeed keys accepted, not acted on
    path: Path | None = None
    # Filled when load_config was given a world size: the batch triad after DeepSpeed's rule.
    batch: BatchResolution | None = None
    # Every "auto" still open ("zero_optimization.reduce_bucket_size", "optimizer.params.lr").
    open_autos: list[str] = field(default_factory=list)
    format: str = "dict"

    def to_json(self) -> str:
        """The user's values as JSON (`auto` kept): what the launcher puts in ZERORUN_CONFIG_JSON."""
        return json.dumps(self.config.to_dict(only_set=True), separators=(",", ":"))

    def resolve_batch(self, world_size: int | None) -> BatchResolution:
        """The batch triad for `world_size` (ConfigError with the arithmetic on a mismatch)."""
        c = self.config
        return resolve_batch(
            c.train_batch_size,
            c.train_micro_batch_size_per_gpu,
            c.gradient_accumulation_steps,
            world_size,
            source=str(self.path) if self.path else "",
        )


def _fail(raw: RawConfig, problems: list[str], cls: type[ConfigError] = ConfigError) -> ConfigError:
    if len(problems) == 1:
        err = cls(f"{raw.name}: {problems[0]}")
    else:
        listing = "\n".join(f"  - {p}" for p in problems)
        err = cls(f"{raw.name}: {len(problems)} problems:\n{listing}")
    # One line per problem, for machine-readable output (`print-config --json`).
    err.problems = [f"{raw.name}: {p}" for p in problems]  # type: ignore[attr-defined]
    return err


def load_config(
    source: str | Path | dict[str, Any], world_size: int | None = None, *, resume_from: str | None = None
) -> LoadedConfig:
    """Read and validate a config: a path (DeepSpeed JSON with comments, or YAML) or a dict.

    Raises ConfigError (naming the file, the key with its line, and the fix) for anything no
    run could use. With `world_size`, the batch triad is also resolved and checked.
    `resume_from`: the launcher's --resume_from, a checkpoint directory besides the config's
    (in a rank, ZERORUN_RESUME_FROM stands for it).
    Never imports torch.
    """
    raw = read_source(source)
    bad_keys = [k for k in raw.data if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"{raw.name}: config keys must be strings, found {bad_keys[0]!r}")
    warnings = rewrite_aliases(raw)
    try:
        config = ZerorunConfig.model_validate(raw.data)
    except ValidationError as err:
        raise _fail(raw, format_validation_error(raw, err, ZerorunConfig)) from None
    errors, rule_warnings, notices = check_rules(raw, config, resume_from=resume_from)
    unsupported = check_runtime_support(raw, config)
    if errors or unsupported:
        raise _fail(raw, errors + unsupported, UnsupportedByRuntime if unsupported else ConfigError)
    loaded = LoadedConfig(
        config=config,
        warnings=warnings + rule_warnings,
        notices=notices,
        path=raw.path,
        open_autos=open_autos(config),
        format=raw.format,
    )
    # Raises on contradictions among the given numbers (with a world size: on any mismatch).
    batch = loaded.resolve_batch(world_size)
    loaded.batch = batch if world_size is not None else None
    return loaded

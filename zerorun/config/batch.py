"""The batch triad: train_batch_size = micro batch × gradient accumulation steps × world size.

DeepSpeed's rule: give any two (or only one of train/micro, the accumulation then being 1)
and the rest is derived; all three must agree. `"auto"` (Hugging Face's integration writes
it) is *open*: derived here only when the other two are concrete, otherwise left open for
the training script / integration to fill -- never replaced by a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerorun.errors import ConfigError

__all__ = ["BatchResolution", "resolve_batch", "TRIAD", "OPEN_NOTE", "Rebatch", "rebatch"]

TRIAD = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OPEN_NOTE = "to be filled by the training script / integration"
_SHORT = {"train_batch_size": "train", "train_micro_batch_size_per_gpu": "micro", "gradient_accumulation_steps": "accum"}


@dataclass(frozen=True)
class BatchResolution:
    """The triad after DeepSpeed's rule: values (None while open) and how they were obtained."""

    world_size: int | None
    train_batch_size: int | None
    train_micro_batch_size_per_gpu: int | None
    gradient_accumulation_steps: int | None
    given: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()
    open: tuple[str, ...] = ()
    lines: tuple[str, ...] = field(default=())  # the arithmetic, for print-config

    @property
    def complete(self) -> bool:
        return not self.open and None not in (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "given": list(self.given),
            "derived": list(self.derived),
            "open": list(self.open),
            "arithmetic": list(self.lines),
        }


def _err(where: str, message: str) -> ConfigError:
    return ConfigError(f"{where}: {message}" if where else message)


def resolve_batch(
    train_batch_size: int | str | None,
    train_micro_batch_size_per_gpu: int | str | None,
    gradient_accumulation_steps: int | str | None,
    world_size: int | None,
    *,
    source: str = "",
) -> BatchResolution:
    """Apply DeepSpeed's rule for a data-parallel world size (None: not known yet).

    Each value is an int, `"auto"` (open) or None (not given). Raises ConfigError on a
    contradiction or an impossible division, with the arithmetic in the message; values that
    cannot be known yet are returned in `open` (with no batch size at all, everything is open).
    """
    if world_size is not None and world_size < 1:
        raise _err(source, f"world size must be at least 1, got {world_size}")
    values = {
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": gradient_accumulation_steps,
    }
    given = tuple(k for k in TRIAD if isinstance(values[k], int))
    autos = tuple(k for k in TRIAD if values[k] == "auto")
    train = values["train_batch_size"] if isinstance(values["train_batch_size"], int) else None
    micro = values["train_micro_batch_size_per_gpu"] if isinstance(values["train_micro_batch_size_per_gpu"], int) else None
    accum = values["gradient_accumulation_steps"] if isinstance(values["gradient_accumulation_steps"], int) else None
    n = world_size
    ws = "world size" if n is None else f"world size {n}"
    lines: list[str] = []
    derived: list[str] = []

    if not (train is not None or micro is not None) and not autos:
        # Nothing fixes a batch size. Not an error here: the training script may pass one
        # (zerorun.initialize takes a DataLoader's batch size); DeepSpeed itself would fail.
        open_ = tuple(k for k in TRIAD if k not in given)
        lines.append(
            "no batch size given: set train_micro_batch_size_per_gpu (per rank) or train_batch_size (global), "
            "or the training script must pass one"
        )
        return _result(n, None, None, accum, given, derived, open_, lines)

    if train is not None and micro is not None and accum is not None:
        if n is not None:
            product = micro * accum * n
            if product != train:
                raise _err(
                    source,
                    f"batch sizes disagree: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} "
                    f"× gradient_accumulation_steps {accum} × {ws} = {product}. "
                    f"Fix one of them, or leave train_batch_size out to have it derived",
                )
            lines.append(f"train_batch_size {train} = micro {micro} × accum {accum} × {ws} ✓")
        else:
            if train % (micro * accum):
                raise _err(
                    source,
                    f"train_batch_size {train} is not a multiple of train_micro_batch_size_per_gpu {micro} × "
                    f"gradient_accumulation_steps {accum} = {micro * accum}, so no world size fits",
                )
            lines.append(f"world size must be train {train} / (micro {micro} × accum {accum}) = {train // (micro * accum)}")
    elif train is not None and micro is not None:
        if n is None:
            lines.append(f"accum = train {train} / (micro {micro} × world size), once the world size is known")
            return _result(n, train, micro, None, given, derived, ("gradient_accumulation_steps",), lines)
        accum, _ = _divide(train, micro * n, "train_batch_size", f"train_micro_batch_size_per_gpu {micro} × {ws}", source)
        derived.append("gradient_accumulation_steps")
        lines.append(f"accum = train {train} / (micro {micro} × {ws}) = {accum}")
    elif train is not None and accum is not None:
        if n is None:
            lines.append(f"micro = train {train} / (accum {accum} × world size), once the world size is known")
            return _result(n, train, None, accum, given, derived, ("train_micro_batch_size_per_gpu",), lines)
        micro, _ = _divide(train, accum * n, "train_batch_size", f"gradient_accumulation_steps {accum} × {ws}", source)
        derived.append("train_micro_batch_size_per_gpu")
        lines.append(f"micro = train {train} / (accum {accum} × {ws}) = {micro}")
    elif micro is not None and accum is not None:
        if n is None:
            lines.append(f"train = micro {micro} × accum {accum} × world size, once the world size is known")
            return _result(n, None, micro, accum, given, derived, ("train_batch_size",), lines)
        train = micro * accum * n
        derived.append("train_batch_size")
        lines.append(f"train = micro {micro} × accum {accum} × {ws} = {train}")
    elif train is not None and not autos:
        # DeepSpeed: only train_batch_size -> accumulation 1, micro = train / world.
        accum = 1
        derived.append("gradient_accumulation_steps")
        if n is None:
            lines.append(f"accum = 1 (not given); micro = train {train} / world size, once it is known")
            return _result(n, train, None, accum, given, derived, ("train_micro_batch_size_per_gpu",), lines)
        micro, _ = _divide(train, n, "train_batch_size", ws, source)
        derived.append("train_micro_batch_size_per_gpu")
        lines.append(f"accum = 1 (not given); micro = train {train} / {ws} = {micro}")
    elif micro is not None and not autos:
        accum = 1
        derived.append("gradient_accumulation_steps")
        if n is None:
            lines.append(f"accum = 1 (not given); train = micro {micro} × world size, once it is known")
            return _result(n, None, micro, accum, given, derived, ("train_batch_size",), lines)
        train = micro * n
        derived.append("train_batch_size")
        lines.append(f"accum = 1 (not given); train = micro {micro} × 1 × {ws} = {train}")
    else:
        # One concrete value (or none) and at least one `auto`: what remains depends on values
        # only the training script / integration knows.
        open_ = tuple(k for k in TRIAD if k not in given)
        lines.append(
            "open: " + ", ".join(f"{_SHORT[k]} ({'auto' if k in autos else 'not given'})" for k in open_) + f" -- {OPEN_NOTE}"
        )
        return _result(n, train, micro, accum, given, derived, open_, lines)
    return _result(n, train, micro, accum, given, derived, (), lines)


@dataclass(frozen=True)
class Rebatch:
    """The triad a job restarted at another world size trains with (`rebatch`), and why."""

    world_size: int
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    message: str

    def values(self) -> dict[str, int]:
        return {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    def to_env(self) -> str:
        """ZERORUN_BATCH's value (Contract 2): the ranks of a job at this world size use these."""
        import json

        return json.dumps({"world_size": self.world_size, **self.values()}, separators=(",", ":"))


def rebatch(
    train_batch_size: int | str | None,
    train_micro_batch_size_per_gpu: int | str | None,
    gradient_accumulation_steps: int | str | None,
    *,
    from_world: int,
    to_world: int,
) -> Rebatch | None:
    """The batch triad for a job that trained at `from_world` ranks and continues at `to_world`
    (a restart without the nodes that failed). None when nothing is to change: the same world
    size, or a triad with an `auto` or nothing given (the training script or integration fills
    it for the world it runs at).

    The micro batch stays (it is what fits in a device's memory). `train_batch_size` -- the
    global batch the job trained with, given or derived -- is kept when it is a multiple of
    micro × the new world size (`gradient_accumulation_steps` changes); else it changes to
    micro × accum × the new world size, and the message says so. Pure."""
    values = (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)
    if from_world == to_world or any(v == "auto" for v in values):
        return None
    before = resolve_batch(*values, from_world)
    train, micro, accum = before.train_batch_size, before.train_micro_batch_size_per_gpu, before.gradient_accumulation_steps
    if not before.complete or train is None or micro is None or accum is None:
        return None
    head = f"world size {from_world} -> {to_world}: "
    was = f"(was micro {micro} × accum {accum} × {from_world} ranks)"
    if train % (micro * to_world) == 0:
        new_accum = train // (micro * to_world)
        message = (
            f"{head}train_batch_size {train} kept = micro {micro} × accum {new_accum} × {to_world} ranks; "
            f"gradient_accumulation_steps {accum} -> {new_accum} {was}"
        )
        return Rebatch(to_world, train, micro, new_accum, message)
    new_train = micro * accum * to_world
    message = (
        f"{head}train_batch_size {train} is not a multiple of micro {micro} × {to_world} ranks = {micro * to_world}, "
        f"so it changes: train_batch_size {train} -> {new_train} = micro {micro} × accum {accum} × {to_world} ranks "
        f"{was}; the learning rate and schedule are not rescaled"
    )
    return Rebatch(to_world, new_train, micro, accum, message)


def _divide(total: int, by: int, total_name: str, by_text: str, source: str) -> tuple[int, int]:
    quotient, rest = divmod(total, by)
    if rest or quotient < 1:
        raise _err(
            source,
            f"{total_name} {total} is not divisible by {by_text} = {by} "
            f"({total} / {by} = {total / by:g}); choose sizes whose product matches",
        )
    return quotient, rest


def _result(
    n: int | None,
    train: int | None,
    micro: int | None,
    accum: int | None,
    given: tuple[str, ...],
    derived: list[str],
    open_: tuple[str, ...],
    lines: list[str],
) -> BatchResolution:
    return BatchResolution(
        world_size=n,
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        given=given,
        derived=tuple(derived),
        open=open_,
        lines=tuple(lines),
    )

"""`checkpoint(fn, *args)`: DeepSpeed's (and Megatron's) activation checkpointing.

The block runs without keeping its activations; its tensor inputs are kept (stash.py: on the
device, in pinned host memory, or partitioned) and in backward the block runs again, with the
RNG state and autocast state of its first run, to produce the gradients. This is the reentrant
form DeepSpeed's `deepspeed.checkpointing.checkpoint` has: the recomputation's backward runs
inside the outer backward (ZeRO stages accept that, docs/stage3.md), and at least one tensor
input must require grad for the block's parameters to get gradients (as with
`torch.utils.checkpoint(use_reentrant=True)`).

`configure(...)` sets how (DeepSpeed's signature); `zerorun.initialize` configures from the
config's `activation_checkpointing` section unless the script called `configure` itself.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from zerorun.runtime.activations.options import ActivationOptions
from zerorun.runtime.activations.stash import PartitionGroup, Stash

__all__ = [
    "checkpoint",
    "configure",
    "configure_from_options",
    "is_configured",
    "reset",
    "current",
    "take_profile",
]


@dataclass(frozen=True)
class _State:
    options: ActivationOptions
    partition: PartitionGroup | None
    explicit: bool  # set by the script's configure(), which initialize does not override


_DEFAULT = _State(ActivationOptions(False, False, False, False), None, explicit=False)
_state = _DEFAULT

# `profile`: (start, end) marks of every checkpointed forward and recomputation since the last
# take_profile(); CUDA events (no sync when recorded) or perf_counter values.
_marks: dict[str, list[tuple[Any, Any]]] = {"forward": [], "recompute": []}


def _mark(device: torch.device | None) -> Any:
    if device is not None and device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def take_profile() -> dict[str, float] | None:
    """`activation_checkpointing.profile`: milliseconds spent in checkpointed forwards and in
    their recomputations, and the number of each, since the last call (None when nothing was
    profiled). Waits for the recorded CUDA events: call it where a sync is acceptable (the
    `steps_per_print` report does)."""
    if not any(_marks.values()):
        return None
    out: dict[str, float] = {}
    for name, pairs in _marks.items():
        total = 0.0
        for begin, end in pairs:
            if isinstance(end, torch.cuda.Event):
                end.synchronize()
                total += float(begin.elapsed_time(end))
            else:
                total += (end - begin) * 1000.0
        out[f"{name}_ms"] = total
        out[f"{name}_calls"] = float(len(pairs))
        pairs.clear()
    return out


def current() -> tuple[ActivationOptions, PartitionGroup | None]:
    return _state.options, _state.partition


def is_configured() -> bool:
    return _state is not _DEFAULT


def reset() -> None:
    global _state
    _state = _DEFAULT


def _partition_group(mpu: Any) -> PartitionGroup | None:
    if mpu is None:
        return None
    return PartitionGroup(
        group=mpu.get_model_parallel_group(),
        rank=int(mpu.get_model_parallel_rank()),
        size=int(mpu.get_model_parallel_world_size()),
    )


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`. `deepspeed_config`: a path, a dict or
    a loaded config (its `activation_checkpointing` section); the other arguments override it.
    `mpu_`: Megatron's model-parallel unit, the group `partition_activations` splits across.
    `contiguous_checkpointing`/`num_checkpoints` are accepted and have no effect
    (docs/config-reference.md says why)."""
    global _state
    options = _state.options if _state.explicit else _DEFAULT.options
    if deepspeed_config is not None:
        from zerorun.config import load_config

        cfg = deepspeed_config
        if not hasattr(cfg, "activation_checkpointing"):
            cfg = getattr(cfg, "config", None) or load_config(deepspeed_config).config
        options = ActivationOptions.from_config(cfg)
    if partition_activations is not None:
        options = replace(options, partition_activations=bool(partition_activations))
    if checkpoint_in_cpu is not None:
        options = replace(options, cpu_checkpointing=bool(checkpoint_in_cpu))
    if synchronize is not None:
        options = replace(options, synchronize=bool(synchronize))
    if profile is not None:
        options = replace(options, profile=bool(profile))
    partition = _partition_group(mpu_)
    if options.partition_activations and (partition is None or partition.size == 1):
        warnings.warn(
            "activation_checkpointing.partition_activations has no effect without a model-parallel group of "
            "more than one rank (configure(mpu_=...)): data-parallel ranks hold different activations",
            stacklevel=2,
        )
    _state = _State(options, partition, explicit=True)


def configure_from_options(options: ActivationOptions) -> None:
    """What `zerorun.initialize` calls: the config's section, unless the script configured."""
    global _state
    if not _state.explicit:
        _state = _State(options, _state.partition, explicit=False)


def _device_of(args: tuple[Any, ...]) -> torch.device | None:
    for a in args:
        if torch.is_tensor(a):
            return a.device
    return None


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], state: _State, *args: Any) -> Any:
        device = _device_of(args)
        ctx.run_function = run_function
        ctx.partition = state.partition
        ctx.device = device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
        dev_type = device.type if device is not None else "cpu"
        ctx.autocast = (dev_type, torch.is_autocast_enabled(dev_type), torch.get_autocast_dtype(dev_type))
        sync = state.options.synchronize and device is not None and device.type == "cuda"
        if sync:
            torch.cuda.synchronize(device)  # debugging aid the config asked for
        ctx.profile = state.options.profile
        begin = _mark(device) if ctx.profile else None
        with torch.no_grad():
            outputs = run_function(*args)
        if ctx.profile:
            _marks["forward"].append((begin, _mark(device)))
        if sync:
            torch.cuda.synchronize(device)
        ctx.stash = Stash(args, cpu=state.options.cpu_checkpointing, partition=state.partition)
        ctx.input_requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        inputs = ctx.stash.restore(ctx.partition)
        ctx.stash = None
        detached = [
            x.detach().requires_grad_(req) if torch.is_tensor(x) else x
            for x, req in zip(inputs, ctx.input_requires_grad, strict=True)
        ]
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        dev_type, autocast_on, autocast_dtype = ctx.autocast
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            begin = _mark(ctx.device) if ctx.profile else None
            with torch.enable_grad(), torch.autocast(dev_type, dtype=autocast_dtype, enabled=autocast_on):
                outputs = ctx.run_function(*detached)
            if ctx.profile:
                _marks["recompute"].append((begin, _mark(ctx.device)))
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=False)
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if not pairs:
            raise RuntimeError(
                "zerorun.checkpointing.checkpoint: none of the block's outputs requires grad in the "
                "recomputation; nothing to backpropagate"
            )
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in detached))


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run `function(*args)` without keeping its activations; recompute them in backward.
    `args` are positional (DeepSpeed's signature); tensors among them are the checkpointed
    activations (kept as `configure` says). Returns what `function` returns."""
    if not torch.is_grad_enabled():
        return function(*args)  # nothing to recompute for
    return _CheckpointFunction.apply(function, _state, *args)

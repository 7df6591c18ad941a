"""``DeepSpeedEngine``: DeepSpeed's engine surface over a zerorun ``Engine``.

An ``nn.Module`` holding the model as ``.module``, as DeepSpeed's engine is (accelerate unwraps
it with ``isinstance`` + ``.module``, and walks ``_modules``); ``deepspeed.initialize``
(_initialize.py) builds it.

Gradient accumulation. A DeepSpeed script calls ``backward`` then ``step`` for every
micro-batch and the engine finds the boundary by counting. accelerate instead announces it --
``set_gradient_accumulation_boundary(sync)`` before every ``backward`` -- and calls ``step``
only at the boundary, with a short last window at the end of an epoch. Both are handled here
by counting the micro-batches of the current window (``_window``): the first micro-batch of a
window starts a fresh accumulation, the boundary (announced, or the ``gas``-th micro-batch)
reduces, and the next ``step`` runs zerorun's model step (norm, clip, optimizer, scheduler,
zero) on the inner engine. ``scale_wrt_gas=False`` (Trainer's loss is already divided by the
accumulation steps) skips the 1/gas factor.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerorun.compat.deepspeed._surface import missing, unsupported
from zerorun.errors import RuntimeConfigError

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(nn.Module):
    """DeepSpeed's engine over a zerorun ``Engine`` (``.zerorun_engine``)."""

    def __init__(
        self,
        engine: Any,
        config: dict[str, Any],
        *,
        training_dataloader: Any = None,
        evaluation_only: bool = False,
        param_order: list[str] | None = None,
    ) -> None:
        """``param_order``: the parameters' names in the order the script gave them to the
        optimizer (its param groups one after another), the order DeepSpeed flattens a group in;
        default: the module's registration order."""
        super().__init__()
        self.module = engine.module
        # Not a submodule attribute: the inner engine is no nn.Module and owns no parameters.
        self.__dict__["_engine"] = engine
        self.__dict__["_config"] = config
        registered = [n for n, _ in engine.module.named_parameters()]
        given = [n for n in (param_order or []) if n in set(registered)]
        self._param_order = {n: i for i, n in enumerate([*given, *(n for n in registered if n not in set(given))])}
        self.training_dataloader = training_dataloader
        self._evaluation_only = evaluation_only
        self._window = 0  # micro-batches backpropagated in the current accumulation window
        self._window_closed = False  # the last backward was the window's boundary
        self._explicit_boundary: bool | None = None
        self._no_sync = False
        self._step_applied = False
        # DeepSpeed's norm of the last step: None before any step; a skipped (fp16 overflow)
        # step leaves it unchanged, 0.0 when no step has been applied yet (its ZeRO optimizers
        # start from 0.0 and set the norm only after the overflow check). An applied step's norm
        # stays the device tensor until get_global_grad_norm() reads it: no host sync per step.
        self._grad_norm: torch.Tensor | float | None = None
        if getattr(engine, "checkpointing", None) is not None:
            # The engine's own saves (every_n_steps, preemption, async) carry DeepSpeed's files too.
            engine.checkpointing.before_commit = self._write_deepspeed_layout
        if not evaluation_only:
            # DeepSpeed's ZeRO optimizers carry `overflow`; accelerate reads it after each step
            # to decide whether the Trainer's scheduler steps.
            engine.optimizer.overflow = False
            self._expose_master_weights()

    def _expose_master_weights(self) -> None:
        """The fp32 master shards under the names DeepSpeed's ZeRO optimizers give them
        (``single_partition_of_fp32_groups`` at stages 1-2, ``fp32_partitioned_groups_flat`` at
        stage 3): tests and tools read them to check the masters are fp32. The same tensors
        the optimizer steps (a checkpoint load copies into them)."""
        state = getattr(self._engine.stage, "state", None)
        masters = list(getattr(state, "masters", []))
        opt = self._engine.optimizer
        if self._engine.settings.stage >= 3:
            opt.fp32_partitioned_groups_flat = masters
        elif self._engine.settings.stage >= 1:
            opt.single_partition_of_fp32_groups = masters

    # -- what is not here ----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                raise
        raise missing(f"deepspeed.DeepSpeedEngine.{name}")

    # -- forward -------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.forward(*args, **kwargs)

    # -- backward / step -----------------------------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """From now on the caller says which micro-batch ends a window (accelerate does)."""
        self._explicit_boundary = bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._no_sync:
            return False
        if self._explicit_boundary is not None:
            return self._explicit_boundary
        return self._window + 1 >= self._engine.settings.batch.grad_accum

    def _require_training(self, what: str) -> None:
        if self._evaluation_only:
            raise RuntimeConfigError(
                f"engine.{what}(): this engine was initialized without an optimizer (evaluation only); give "
                "deepspeed.initialize an optimizer or an `optimizer` config section to train"
            )

    def backward(
        self,
        loss: torch.Tensor,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
    ) -> torch.Tensor:
        self._require_training("backward")
        if not allreduce_gradients:
            unsupported("engine.backward(allreduce_gradients=False)", "use engine.no_sync() (stages 0-1)")
        del release_loss
        inner = self._engine
        boundary = self.is_gradient_accumulation_boundary()
        # The window is the caller's here (accelerate's explicit boundary, no_sync), not the
        # engine's micro-step count; the backward itself is the engine's.
        inner.backward_pass(
            loss, boundary=boundary, first_micro=self._window == 0, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas
        )
        inner.micro_steps += 1
        inner.global_samples += inner.settings.batch.micro_batch * inner.world_size
        self._window += 1
        self._window_closed = boundary
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the end of a window: zerorun's model step. Between: nothing (as DeepSpeed)."""
        self._require_training("step")
        if lr_kwargs:
            unsupported("engine.step(lr_kwargs=...)", "schedulers take no step arguments in zerorun")
        inner = self._engine
        inner.stage.end_backward()
        self._step_applied = False
        if not self._window_closed:
            return
        skipped = inner.skipped_steps
        # The inner engine's step without its micro-batch counting (done in backward here).
        with inner.reporter.phase("step"):
            inner._take_model_step()
        inner._report_step()  # steps_per_print report, monitors, flops profiler (runtime/observe)
        overflow = inner.skipped_steps != skipped
        if not overflow:
            self._grad_norm = inner._grad_norm
        elif self._grad_norm is None:
            self._grad_norm = 0.0
        inner.optimizer.overflow = overflow
        self._step_applied = not overflow
        self._window = 0
        self._window_closed = False
        if inner.checkpointing is not None:  # as Engine.step: every_n_steps saves; a preemption saves and exits 75
            inner.checkpointing.after_step()

    def was_step_applied(self) -> bool:
        return self._step_applied

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate without reducing (stages 0-1, as in DeepSpeed)."""
        if self._engine.settings.stage >= 2:
            raise RuntimeConfigError(
                f"engine.no_sync() is incompatible with gradient partitioning (ZeRO stage {self._engine.settings.stage}); "
                "DeepSpeed refuses it too: accumulate with gradient_accumulation_steps instead"
            )
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last applied step, as DeepSpeed: never the non-finite norm
        of a skipped fp16 step (see ``_grad_norm``)."""
        if torch.is_tensor(self._grad_norm):
            self._grad_norm = float(self._grad_norm.item())  # host sync: only when asked
        return self._grad_norm

    # -- DeepSpeed's read-outs -----------------------------------------------------------------
    @property
    def zerorun_engine(self) -> Any:
        return self._engine

    @property
    def config(self) -> dict[str, Any]:
        return self._config

    @property
    def optimizer(self) -> Any:
        return None if self._evaluation_only else self._engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self._engine.lr_scheduler

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self._engine.global_rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def dp_world_size(self) -> int:
        return self._engine.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def global_steps(self) -> int:
        return self._engine.global_steps

    @property
    def global_samples(self) -> int:
        return self._engine.global_samples

    @property
    def micro_steps(self) -> int:
        return self._engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self._engine.skipped_steps

    def train_batch_size(self) -> int:
        return self._engine.settings.batch.train_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._engine.settings.batch.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._engine.settings.batch.grad_accum

    def zero_optimization_stage(self) -> int:
        return self._engine.settings.stage

    def zero_optimization(self) -> bool:
        return self._engine.settings.stage > 0

    def zero_optimization_partition_weights(self) -> bool:
        return self._engine.settings.stage >= 3

    def fp16_enabled(self) -> bool:
        return bool(self._engine.settings.precision.fp16)

    def bf16_enabled(self) -> bool:
        return self._engine.settings.precision.policy.param_dtype == torch.bfloat16 and not self._engine.settings.precision.fp16

    def gradient_clipping(self) -> float:
        return self._engine.settings.optimizer.gradient_clipping

    def get_lr(self) -> list[float]:
        return self._engine.get_lr()

    def get_loss_scale(self) -> float:
        return self._engine.get_loss_scale()

    def memory_summary(self) -> dict[str, dict[str, int]]:
        return self._engine.memory_summary()

    # -- checkpoints and weights ---------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """zerorun's checkpoint with DeepSpeed's files beside it (tools read them:
        ``zero_to_fp32.py``, ``module`` in ``mp_rank_00_model_states.pt``, the optimizer states;
        runtime/checkpoint/deepspeed_layout.py), both written before the save commits: ``latest``
        never names a tag whose DeepSpeed files are incomplete. Collective."""
        return self._engine.save_checkpoint(
            save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters,
            before_commit=self._write_deepspeed_layout,
        )

    def _param_group_names(self) -> list[list[str]]:
        """The trainable parameters' names per optimizer param group, each group in the order
        DeepSpeed flattens it (the order the script gave; zerorun's buffers hold them in
        gradient order): DeepSpeed's loader places partitions by position."""
        groups: dict[int, list[str]] = {}
        for layout in self._engine.stage.state.layouts:
            groups.setdefault(layout.group, []).extend(slot.name for slot in layout.slots)
        last = len(self._param_order)
        return [sorted(groups.get(g, []), key=lambda n: self._param_order.get(n, last))
                for g in range(len(self._engine.optimizer.param_groups))]

    def _write_deepspeed_layout(self, tmp_tag_dir: Path, rank: int) -> None:
        from zerorun.runtime.checkpoint import deepspeed_files, deepspeed_layout
        from zerorun.runtime.checkpoint.format import ENGINE_STATE_FILE

        # DeepSpeed's scaler object for its loader: the saved scaler state (an asynchronous save
        # writes a snapshot while training goes on) with the scaler's fixed settings.
        scaler = self._engine.loss_scaler
        saved = torch.load(tmp_tag_dir / ENGINE_STATE_FILE, map_location="cpu", weights_only=False)["loss_scaler"]
        ds_scaler = deepspeed_files.loss_scaler_object(saved["scale"], dynamic=bool(saved["dynamic"]), state={
            **saved, "window": scaler.window, "min_scale": scaler.min_scale, "hysteresis": scaler.hysteresis,
            "consecutive_hysteresis": scaler.consecutive_hysteresis, "raise_error_at_min_scale": scaler.raise_error_at_min_scale,
        })
        deepspeed_layout.write_rank_files(
            tmp_tag_dir, rank, ds_config=self._config, groups=self._param_group_names(), loss_scaler=ds_scaler
        )
        if rank == 0:
            deepspeed_layout.copy_recovery_script(tmp_tag_dir.parent)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        if custom_load_fn is not None:
            unsupported("engine.load_checkpoint(custom_load_fn=...)", "zerorun loads its own shard format only")
        result = self._engine.load_checkpoint(
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states and not self._evaluation_only,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only or self._evaluation_only,
            load_module_strict=load_module_strict,
        )
        self._window, self._window_closed = 0, False
        return result

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        return self._engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        zero = self._config.get("zero_optimization") or {}
        return bool(zero.get("stage3_gather_16bit_weights_on_model_save", False))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The full weights in the compute dtype on rank 0 (None elsewhere, as DeepSpeed).

        Collective. Module by module (DeepSpeed's order of work): the module's own parameters
        are gathered, rank 0 keeps a CPU copy, the others keep nothing -- so only rank 0 ever
        holds the whole model. Tied parameters are copied once, under every name."""
        if self._engine.settings.stage != 3:
            raise ValueError("this function requires ZeRO-3 mode")
        from zerorun.zero import GatheredParameters

        rank0 = self.global_rank == 0
        copies: dict[int, torch.Tensor] = {}
        seen: set[int] = set()  # the same on every rank: decides the collectives
        values: dict[str, torch.Tensor] = {}
        for prefix, module in self.module.named_modules():
            own = [(name, p) for name, p in module._parameters.items() if p is not None]
            todo = [p for _, p in own if id(p) not in seen]
            seen.update(id(p) for p in todo)
            if todo:
                with GatheredParameters(todo, modifier_rank=None):
                    if rank0:
                        for p in todo:
                            copies[id(p)] = p.data.detach().to("cpu", copy=True)
            if rank0:
                for name, p in own:
                    values[f"{prefix}.{name}" if prefix else name] = copies[id(p)]
        if not rank0:
            return None
        frozen = set()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state: dict[str, Any] = OrderedDict()
        # Keys and order of state_dict(); buffers are never partitioned.
        for key, value in self.module.state_dict(keep_vars=True).items():
            if key in frozen:
                continue
            state[key] = values[key] if key in values else value.detach().to("cpu", copy=True)
        return state

    def destroy(self) -> None:
        self._engine.destroy()

    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """DeepSpeed's ``engine.compile``: the wrapped model is compiled in place (zerorun's hooks
        run eagerly around the compiled code)."""
        self._engine.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        return self._engine.is_compiled

"""The training engine: what ``zerorun.initialize`` returns.

One training step, as a script drives it (DeepSpeed's shape):

    for batch in loader:
        loss = loss_fn(engine(batch))   # forward: the user's module, inputs cast to the compute dtype
        engine.backward(loss)           # loss * scale / accumulation steps; gradients reduced in buckets
        engine.step()                   # every micro-batch; updates only at the accumulation boundary

At the boundary, ``step`` does, in this order: global gradient norm (one small all-reduce at
stages 1+; the fp16 overflow flag comes with it), skip on overflow (fp16) or unscale + clip in
one multiply, optimizer step on this rank's shards, write-back of the updated parameters,
scheduler step, zero the gradients. The stage (``Stage``, runtime/stage_protocol.py; flat_stage.py for
0-2, runtime/stage3/ for 3) does everything that differs between stages; this file does not
branch on the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from zerorun.channel import events
from zerorun.errors import RuntimeConfigError
from zerorun.runtime.activations import configure_from_options as configure_activation_checkpointing
from zerorun.runtime.collectives import Communicator
from zerorun.runtime.memory import MemoryLedger
from zerorun.runtime.observe import StepReporter
from zerorun.runtime.precision import LossScaler
from zerorun.runtime.settings import RuntimeSettings
from zerorun.runtime.stage_protocol import Stage

if TYPE_CHECKING:
    from zerorun.runtime.checkpoint.autosave import EngineCheckpointing

__all__ = ["Engine"]


def _cast_inputs(value: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        cast = [_cast_inputs(v, dtype) for v in value]
        return type(value)(cast) if not hasattr(value, "_fields") else type(value)(*cast)
    if isinstance(value, Mapping):
        rebuild: type = type(value)  # dict, OrderedDict, transformers' BatchEncoding, ...
        return rebuild({k: _cast_inputs(v, dtype) for k, v in value.items()})
    return value


def _wait_params_hook(stage: Stage) -> Callable[..., None]:
    def hook(*_: object) -> None:  # state_dict pre-hook (module, prefix, keep_vars)
        stage.wait_params()

    return hook


def _before_forward_hook(stage: Stage) -> Callable[..., None]:
    def hook(*_: object) -> None:  # forward pre-hook (module, args)
        stage.before_forward()

    return hook


class Engine:
    def __init__(
        self,
        *,
        module: nn.Module,
        stage: Stage,
        settings: RuntimeSettings,
        comm: Communicator,
        optimizer: Optimizer,
        lr_scheduler: Any,
        scaler: LossScaler,
        device: torch.device,
    ) -> None:
        self.module = module
        self.stage = stage
        self.settings = settings
        self.comm = comm
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = scaler
        self.device = device
        self._accum = settings.batch.grad_accum
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._grad_norm: torch.Tensor | None = None
        self._last_loss: torch.Tensor | None = None
        self._step_applied = False
        self._backward_since_step = False
        self._compute_dtype = settings.precision.policy.param_dtype
        # Saves/resume the engine does by itself (runtime/checkpoint/autosave.py; set by
        # initialize when the config or the launcher asks for them), and what it resumed from.
        self.checkpointing: EngineCheckpointing | None = None
        self.resumed_from: str | None = None
        self.resumed_client_state: dict[str, Any] = {}
        self.training_dataloader: Any = None  # the loader initialize built from training_data
        events.set_memory_provider(self.memory_summary)
        # steps_per_print, wall_clock_breakdown, monitors, flops_profiler (runtime/observe;
        # docs/observability.md): the reporter's hooks below are the only ones in this file.
        self.reporter = StepReporter(
            settings.observe,
            rank=comm.rank,
            world_size=comm.world_size,
            device=device,
            fp16=settings.precision.fp16,
            module=module,
            compute_dtype=settings.precision.policy.param_dtype,
            micro_batch=settings.batch.micro_batch,
        )
        if self.reporter.timers is not None:  # the placement's own sub-phases (offload), if any
            source = stage.state.placement.phase_timer()
            if source is not None:
                self.reporter.timers.sources.append(source)
        configure_activation_checkpointing(settings.activation)  # unless the script called configure()
        # Stages 1-2 leave the step's all-gather of the updated parameters in flight, to overlap
        # the next forward (stage.wait_params); with CPU offload the write-backs themselves may
        # still run (the stage's own hooks settle them module by module). The module's next
        # forward -- train or eval, through the engine or called directly -- waits for what its
        # modules' hooks do not (stage.before_forward), its state_dict() for everything.
        wait = torch._disable_dynamo(_wait_params_hook(stage), recursive=True)  # eager when compiled
        start = torch._disable_dynamo(_before_forward_hook(stage), recursive=True)
        self._param_hooks = [
            module.register_forward_pre_hook(start),
            module.register_state_dict_pre_hook(wait),
        ]
        self._expect_backward()

    # -- forward ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._compute_dtype != torch.float32:
            # DeepSpeed leaves this to the script (fp16.auto_cast); casting floating inputs to the
            # compute dtype is what every mixed-precision script does anyway.
            args = _cast_inputs(args, self._compute_dtype)
            kwargs = _cast_inputs(kwargs, self._compute_dtype)
        self.reporter.on_forward(args, kwargs)
        with self.reporter.phase("fwd"):
            return self.module(*args, **kwargs)

    # -- backward -----------------------------------------------------------------------------
    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Scale by loss scale / accumulation steps, backpropagate, reduce gradients (buckets are
        issued while the backward still runs)."""
        if self._backward_since_step:
            raise RuntimeConfigError(
                "engine.backward() was called twice without engine.step() in between: call "
                "engine.step() after every engine.backward() (it updates only at the accumulation "
                "boundary), or add the losses and call backward once"
            )
        self._backward_since_step = True
        self.backward_pass(
            loss,
            boundary=self.is_gradient_accumulation_boundary(),
            first_micro=self.micro_steps % self._accum == 0,
            retain_graph=retain_graph,
            scale_wrt_gas=scale_wrt_gas,
        )
        return loss

    def backward_pass(
        self, loss: torch.Tensor, *, boundary: bool, first_micro: bool, retain_graph: bool, scale_wrt_gas: bool
    ) -> None:
        """One micro-batch's backward, the part every front end shares (`backward` here, the
        compat layer's DeepSpeedEngine.backward with its own window bookkeeping): open the
        stage's reduction for this micro-batch (`boundary`: it ends the accumulation window;
        `first_micro`: it opens one), scale, backpropagate, finish the reduction, record the
        loss. No step counters move here."""
        self.stage.begin_backward(boundary=boundary, first_micro=first_micro)
        # scale_wrt_gas=False: the script already divided by the accumulation steps (DeepSpeed's flag).
        factor = self.loss_scaler.scale / (self._accum if scale_wrt_gas else 1)
        scaled = loss * factor if factor != 1.0 else loss
        phase = self.reporter.phase  # wall_clock_breakdown (runtime/observe)
        with phase("bwd"):
            with phase("bwd_inner"):
                scaled.backward(retain_graph=retain_graph)
            with phase("bwd_allreduce"):  # the collectives the backward did not hide
                self.stage.end_backward()
        self._last_loss = loss.detach()
        self.reporter.on_backward(self._last_loss)  # steps_per_print's loss

    # -- step ---------------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self._accum == 0

    def step(self) -> None:
        # Idempotent; needed when the script called loss.backward() itself (the hooks still
        # reduced; no 1/accumulation scaling then, as in DeepSpeed).
        self.stage.end_backward()
        self._backward_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with self.reporter.phase("step"):
                self._take_model_step()
        self.micro_steps += 1
        self.global_samples += self.settings.batch.micro_batch * self.comm.world_size
        if boundary:
            self._report_step()
        self._expect_backward()
        if boundary and self.checkpointing is not None:
            self.checkpointing.after_step()  # periodic save; a preemption saves and exits

    def _expect_backward(self) -> None:
        # A script may call loss.backward() instead of engine.backward(): the stage's hooks then
        # open the reduction themselves and must know whether this micro-step ends the
        # accumulation window (reduce now / final for the optimizer) and whether it is the first.
        self.stage.expect_backward(
            boundary=self.is_gradient_accumulation_boundary(),
            first_micro=self.micro_steps % self._accum == 0,
        )

    def _take_model_step(self) -> None:
        phase = self.reporter.phase  # DeepSpeed's ZeRO timer names (wall_clock_breakdown)
        with phase("optimizer_gradients"):
            grads = self.stage.grad_shards()
            scale = self.loss_scaler.scale
            norm = self._global_norm(grads) / scale  # true (unscaled) norm, on device
            self._grad_norm = norm
            overflow = False
            if self.settings.precision.fp16:
                # Host sync: deciding to skip the step needs the value (fp16 only).
                overflow = not bool(torch.isfinite(norm).item())
            if not overflow:
                self._unscale_and_clip(grads, norm, scale)
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        else:
            with phase("optimizer_step"):  # with offload: host copies and the CPU optimizer too
                self.stage.step(grads)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.loss_scaler.update(overflow)
        self.stage.zero_grad()
        self.global_steps += 1

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm over all ranks' shards; each element is owned by one rank (or, at stage 0, held
        identically by all), so every parameter -- tied ones included -- counts once."""
        if not grads:
            return torch.zeros((), device=self.device)
        norms: list[torch.Tensor] | tuple[torch.Tensor, ...]
        if all(g.dtype == torch.float32 for g in grads):
            norms = torch._foreach_norm(grads)
        else:
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        sumsq = torch.stack(norms).square().sum()
        if not self.stage.grads_replicated:
            self.comm.all_reduce_now(sumsq)  # SUM; an inf/nan on any rank makes the sum non-finite
        return sumsq.sqrt()

    def _unscale_and_clip(self, grads: list[torch.Tensor], norm: torch.Tensor, scale: float) -> None:
        clip = self.settings.optimizer.gradient_clipping
        if clip > 0:
            # torch.nn.utils.clip_grad_norm_'s formula, kept on the device (no host sync).
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            if scale != 1.0:
                coef = coef / scale
            torch._foreach_mul_(grads, coef)
        elif scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)

    def _report_step(self) -> None:
        """Record this optimizer step for the reports (runtime/observe: no host sync except
        every ``steps_per_print`` steps)."""
        groups = self.optimizer.param_groups
        self.reporter.after_step(
            step=self.global_steps,
            samples=self.global_samples,
            skipped=self.skipped_steps,
            lrs=[float(g["lr"]) for g in groups],
            moms=[g["betas"] if "betas" in g else g.get("momentum") for g in groups],
            loss_scale=self.loss_scaler.scale,
            grad_norm=self._grad_norm,
        )

    # -- the rest of DeepSpeed's engine surface -----------------------------------------------
    def zero_grad(self) -> None:
        """Clears gradients the module holds. Accumulated (reduced) gradients are owned by the
        engine and cleared by ``step`` at the boundary, so calling this every micro-batch, as
        plain PyTorch loops do, does not break accumulation."""
        for p in self.module.parameters():
            p.grad = None

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the whole model in place (DeepSpeed's ``engine.compile``):
        ``module.compile(backend=backend, **compile_kwargs)``. zerorun's own work (gradient
        hooks, stage 3's gather/release hooks) runs eagerly around the compiled code; compiling
        each block instead (``block.compile()`` before ``initialize``) works too."""
        if schedule is not None or compiled_autograd_enabled:
            raise RuntimeConfigError(
                "engine.compile(): DeepSpeed's compile schedule and compiled autograd are not supported by "
                "zerorun; call engine.compile(backend=..., compile_kwargs=...) without them"
            )
        if self.is_compiled:
            return
        self.module.compile(backend=backend, **(compile_kwargs or {}))
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_compiled", False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    # DeepSpeed exposes the batch arithmetic as methods; so does zerorun.
    def gradient_accumulation_steps(self) -> int:
        return self.settings.batch.grad_accum

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.batch.micro_batch

    def train_batch_size(self) -> int:
        return self.settings.batch.train_batch

    def zero_optimization_stage(self) -> int:
        return self.settings.stage

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped (fp16 overflow)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """Norm of the last step's gradients (before clipping). Reading it is a host sync."""
        return None if self._grad_norm is None else float(self._grad_norm.item())

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    def memory_summary(self) -> dict[str, dict[str, int]]:
        """Bytes the runtime holds, by device and category (memory.py)."""
        ledger = MemoryLedger()
        self.stage.state.placement.add_memory(ledger)  # offload: host buffers, bytes on NVMe
        parts: dict[str, list[torch.Tensor]] = self.stage.memory_tensors()
        ledger.add("params", parts.get("params", []))
        ledger.add("params", (p for p in self.module.parameters() if not p.requires_grad))
        ledger.add("params", self.module.parameters())
        for category in ("master", "grads", "optimizer_states"):
            ledger.add(category, parts.get(category, []))
        ledger.add("module_buffers", self.module.buffers())
        ledger.add_bytes("buffers", str(self.device), self.stage.buffer_peak_bytes())
        return ledger.summary()

    # -- checkpoints: all in runtime/checkpoint/ (docs/checkpoints.md); collective calls -------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        before_commit: Callable[[Path, int], None] | None = None,
    ) -> bool:
        """Collective. `before_commit(tmp_dir, rank)` adds files to the tag before it is committed
        (checkpoint/sharded.py; compat's DeepSpeed layout)."""
        from zerorun.runtime.checkpoint import engine_view

        if self.checkpointing is not None:
            self.checkpointing.wait()  # an asynchronous save still writing
        self.stage.state.synchronize()  # a delayed offload step still running
        self.stage.wait_params()  # the last step's parameter all-gather
        engine_view.save(
            self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, before_commit=before_commit
        )
        return True  # DeepSpeed's return value

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        load_module_strict: bool = True,
    ) -> tuple[str | None, dict[str, Any] | None]:
        from zerorun.runtime.checkpoint import engine_view

        if self.checkpointing is not None:
            self.checkpointing.wait()
        self.stage.state.synchronize()
        self.stage.wait_params()  # nothing may still be writing the parameters the load replaces
        return engine_view.load(
            self,
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            strict=load_module_strict,
        )

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        from zerorun.runtime.checkpoint import engine_view

        self.stage.state.synchronize()
        self.stage.wait_params()
        return engine_view.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Remove the hooks this engine installed (tests build many engines in one process)."""
        if self.checkpointing is not None:
            self.checkpointing.close()  # an asynchronous save in flight is committed first
        self.reporter.close()
        self.stage.wait_params()
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []
        self.stage.remove_hooks()
        self.stage.state.placement.close()
        events.set_memory_provider(None)

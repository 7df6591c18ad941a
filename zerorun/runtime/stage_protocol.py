"""``Stage``: what the engine, checkpoints and offload may ask of a ZeRO stage.

Two implementations: ``flat_stage.FlatStage`` (stages 0-2: parameters replicated in flat buffers,
gradients reduced in buckets, optimizer state sharded from stage 1) and ``stage3.stage.Stage3``
(parameters partitioned in module groups, gathered around their use). ``runtime/api.py:
build_stage`` picks one; nothing else branches on the stage. Anything a caller needs that is not
here is a question for this protocol, not a ``getattr`` on the stage object (docs/architecture.md,
Contract 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from zerorun.runtime.collectives import Communicator
from zerorun.runtime.partition import FlatLayout
from zerorun.runtime.sharded_state import ShardedOptimizerState

__all__ = ["Stage"]


class Stage(Protocol):
    @property
    def stage(self) -> int:
        """The ZeRO stage, 0-3."""
        ...

    @property
    def state(self) -> ShardedOptimizerState:
        """Master shards, the optimizer over them and its placement (checkpoints, memory)."""
        ...

    @property
    def layouts(self) -> list[FlatLayout]:
        """The flat buffers, in ``state.masters`` order."""
        ...

    @property
    def comm(self) -> Communicator:
        """The data-parallel group the stage communicates in."""
        ...

    @property
    def grads_replicated(self) -> bool:
        """True when every rank holds the same full gradients (stage 0): the global norm then
        needs no all-reduce."""
        ...

    # -- one micro-step ----------------------------------------------------------------------
    def expect_backward(self, *, boundary: bool, first_micro: bool) -> None:
        """What the next micro-step is, for a backward the engine does not see start (a script
        calling ``loss.backward()`` itself): the hooks open the reduction with it."""
        ...

    def begin_backward(self, *, boundary: bool, first_micro: bool) -> None: ...

    def end_backward(self) -> None:
        """Finish the reductions of this backward. Idempotent (``engine.step`` calls it again)."""
        ...

    # -- gradient state and the step ----------------------------------------------------------
    def grad_shards(self) -> list[torch.Tensor]:
        """The reduced (averaged) gradients this rank owns, one per flat buffer, reduce dtype."""
        ...

    def step(self, grad_shards: Sequence[torch.Tensor]) -> None:
        """Optimizer step on this rank's shards, then the updated values written back to the
        parameters the forward uses (collective; may still be in flight: ``wait_params``)."""
        ...

    def wait_params(self) -> None:
        """Complete the write-back of the last ``step`` (stages 1-2 leave the all-gather of the
        updated parameters in flight so that it overlaps the next forward; with CPU offload the
        placement may leave write-backs in flight too: ``ShardPlacement.in_flight``). The
        engine calls it before anything that reads parameters (state_dict, checkpoints, 16-bit
        export, GatheredParameters, destroy). Not collective: a rank may call it alone (stages 1-2
        defer write-backs only at one rank, flat_stage.py)."""
        ...

    def before_forward(self) -> None:
        """The engine's forward pre-hook on the root module: complete what the stage's own
        forward hooks will not (without per-module settling: ``wait_params``)."""
        ...

    def zero_grad(self) -> None: ...

    def params_from_masters(self) -> None:
        """Masters -> the parameters the forward uses, outside a step (after a checkpoint load:
        "the masters are the truth"). Collective."""
        ...

    # -- memory and teardown ------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """``params`` / ``grads`` / ``master`` / ``optimizer_states`` -> the tensors held."""
        ...

    def buffer_peak_bytes(self) -> int:
        """Peak bytes of communication buffers (memory's ``buffers`` term)."""
        ...

    def remove_hooks(self) -> None:
        """Remove the autograd/module hooks the stage installed (``engine.destroy``)."""
        ...

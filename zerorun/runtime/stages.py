"""Stages 0, 1 and 2, composed from the shared pieces.

A stage is what the engine talks to between forward and the optimizer; all of them expose

    begin_backward(boundary, first_micro) / end_backward()
    grad_shards()                 reduced gradients this rank owns (reduce dtype)
    grads_replicated              True when every rank holds the same full gradients (stage 0),
                                  so the global norm needs no extra collective
    step(grad_shards)             optimizer on the shards, then updated parameters written back
    zero_grad()
    state                         the ShardedOptimizerState (checkpoints, memory)
    memory_tensors()              category -> tensors, for memory.py

Composition (no stage flags inside the pieces):

    stage | shards per flat buffer | GradReducer            | write-back
    ------+------------------------+------------------------+------------------------------
      0   | 1                      | AllReduceGrads         | copy master -> params
      1   | world size             | BoundaryReduceScatter  | copy to own shard, all-gather
      2   | world size             | PartitionedGrads       | copy to own shard, all-gather

Stage 3 (stage3.py) implements the same interface over its own parameter store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from zerorun.runtime.collectives import Communicator
from zerorun.runtime.flat_params import FlatParamBuffers, TrainableParam
from zerorun.runtime.grad_reduce import (
    AllReduceGrads,
    BoundaryReduceScatter,
    GradReducer,
    PartitionedGrads,
)
from zerorun.runtime.precision import MixedPrecisionPolicy
from zerorun.runtime.sharded_state import ShardedOptimizerState, ShardPlacement

__all__ = ["FlatStage", "build_flat_stage"]

_REDUCERS: dict[int, type[GradReducer]] = {0: AllReduceGrads, 1: BoundaryReduceScatter, 2: PartitionedGrads}


class FlatStage:
    """Stages 0-2: parameters replicated as flat buffers, a reducer, a sharded optimizer state."""

    def __init__(
        self,
        stage: int,
        flat: FlatParamBuffers,
        reducer: GradReducer,
        state: ShardedOptimizerState,
        comm: Communicator,
    ) -> None:
        self.stage = stage
        self.flat = flat
        self.reducer = reducer
        self.state = state
        self.comm = comm
        self.grads_replicated = stage == 0
        self._shard = state.shard_index
        self._own = [flat.shard(i, self._shard) for i in range(len(flat.layouts))]  # views, made once

    @property
    def layouts(self):  # noqa: ANN201 - list[FlatLayout]
        return self.flat.layouts

    def begin_backward(self, *, boundary: bool, first_micro: bool) -> None:
        self.reducer.begin(boundary=boundary, first_micro=first_micro)

    def end_backward(self) -> None:
        self.reducer.end_backward()

    def grad_shards(self) -> list[torch.Tensor]:
        return self.reducer.grad_shards()

    def step(self, grad_shards: Sequence[torch.Tensor]) -> None:
        self.state.step(grad_shards)
        own = self._own
        with torch.no_grad():
            self.state.write_back(own)
            if self.stage > 0:
                pending = [
                    self.comm.all_gather(buf, shard)
                    for buf, shard in zip(self.flat.buffers, own, strict=True)
                ]
                for p in pending:
                    p.wait()

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": list(self.flat.buffers),
            "grads": self.reducer.buffers(),
            "master": list(self.state.masters),
            "optimizer_states": self.state.optimizer_state_tensors(),
        }

    def buffer_peak_bytes(self) -> int:
        return self.reducer.peak_buffer_bytes


def build_flat_stage(
    stage: int,
    trainable: list[TrainableParam],
    *,
    policy: MixedPrecisionPolicy,
    comm: Communicator,
    device: torch.device,
    bucket_numel: int,
    placement: ShardPlacement,
) -> FlatStage:
    """Flatten ``trainable`` into flat buffers (compute dtype), bind the parameters to them and
    create the master shards from the original fp32 values."""
    if stage not in _REDUCERS:
        raise ValueError(f"build_flat_stage handles stages 0-2, not {stage}")
    num_shards = 1 if stage == 0 else comm.world_size
    shard = 0 if stage == 0 else comm.rank
    originals: dict[str, torch.Tensor] = {t.name: t.param.detach() for t in trainable}
    flat = FlatParamBuffers(
        trainable,
        param_dtype=policy.param_dtype,
        device=device,
        num_shards=num_shards,
        bucket_numel=bucket_numel,
    )
    fp32_init: Callable[[int], torch.Tensor] = lambda i: flat.fp32_shard_from(i, shard, originals)  # noqa: E731
    state = ShardedOptimizerState(
        flat.layouts,
        shard,
        [flat.shard(i, shard) for i in range(len(flat.layouts))],
        fp32_init,
        placement,
    )
    flat.bind()
    reducer = _REDUCERS[stage](flat, comm, policy.reduce_dtype)
    # A reduced gradient final during backward goes to the placement at once (offload may start
    # the CPU step there; the default placement ignores it).
    reducer.on_grad_ready = lambda i: state.grad_ready(i, reducer.grad_shards()[i])
    return FlatStage(stage, flat, reducer, state, comm)


def module_param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

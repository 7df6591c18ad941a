"""Collectives on flat buffers (see partition.py for the vocabulary), issued asynchronously.

On CUDA every collective runs on one side *communication stream*: the caller's stream records
an event, the communication stream waits for it, the collective (and any follow-up such as
accumulating a reduced shard) is queued there, and a "done" event is recorded. Completion is
ordered back into the caller's stream with ``Pending.wait()`` (an event wait; no host sync).
Memory that the communication stream touched is kept alive by the ``Pending`` until then, so
the caching allocator never reuses it early -- no ``record_stream``.

On CPU (gloo) a collective returns torch's async work handle; ``Pending.wait()`` blocks.

gloo has no PREMUL_SUM and gathers only into flat 1-D outputs, so averaging is done by
pre-dividing (``Communicator.predivide``) and all buffers here are 1-D. When gloo carries CUDA
tensors (several ranks sharing one GPU) the data is staged through host memory; that mode is
for testing the stream code, not for speed.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to
``all_gather_single``/``reduce_scatter_single`` (the old names warn on every call); torch 2.11
has only the old names. Both are supported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Communicator", "Pending"]

_all_gather_flat: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


class Pending:
    """An issued collective. ``wait()`` orders its completion into the caller's stream (CUDA) or
    blocks until it finished (CPU), then runs the follow-up on CPU, then drops the references
    that kept its tensors alive."""

    __slots__ = ("_work", "_event", "_then", "_keep")

    def __init__(
        self,
        work: dist.Work | None = None,
        event: torch.cuda.Event | None = None,
        then: Callable[[], object] | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._work = work
        self._event = event
        self._then = then
        self._keep = keep

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None
        self._keep = ()


class Communicator:
    """Issues collectives over one process group for one device."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.is_cuda = device.type == "cuda"
        # One rank: every collective is the identity and is skipped, unless
        # ZERORUN_DEBUG_COLLECTIVES=1 asks to issue them anyway (exercises the stream path on
        # one GPU; scripts/gpu_checks.sh uses it).
        self.trivial = self.world_size == 1 and os.environ.get("ZERORUN_DEBUG_COLLECTIVES") != "1"
        # Several ranks sharing one GPU run gloo; gloo's CUDA support is partial, so stage.
        self.host_staged = self.is_cuda and self.backend == "gloo"
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.is_cuda else None

    # -- issuing -----------------------------------------------------------------------------
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, then: Callable[[], object] | None = None
    ) -> Pending:
        """Sum ``input`` (a whole flat buffer) over ranks; this rank's shard lands in ``output``.
        ``then`` runs after the reduction, in stream order (e.g. accumulate ``output``)."""
        if self.trivial:
            return self._local(output, input, then)
        return self._issue(
            lambda o, i: _reduce_scatter_flat(o, i, group=self.group, async_op=True), output, input, then
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """Concatenate every rank's ``input`` shard into ``output`` (may be in place)."""
        if self.trivial:
            return self._local(output, input, None)
        return self._issue(
            lambda o, i: _all_gather_flat(o, i, group=self.group, async_op=True), output, input, None
        )

    def all_reduce(
        self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, then: Callable[[], object] | None = None
    ) -> Pending:
        if self.trivial:
            return self._local(tensor, tensor, then)
        return self._issue(
            lambda o, _i: dist.all_reduce(o, op=op, group=self.group, async_op=True), tensor, tensor, then
        )

    def all_reduce_now(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        """Blocking all-reduce on the caller's stream, for small control values (norms, flags)."""
        if self.trivial:
            return
        if self.host_staged:
            host = tensor.cpu()
            dist.all_reduce(host, op=op, group=self.group)
            tensor.copy_(host)
        else:
            dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast_ints(self, values: list[int], src: int = 0) -> list[int]:
        """Rank ``src``'s list of ints on every rank (same length everywhere); blocking, for
        rare control decisions."""
        if self.trivial:
            return list(values)
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.broadcast(
            t, src=dist.get_global_rank(self.group, src) if self.group is not None else src, group=self.group
        )
        return [int(v) for v in t.tolist()]

    # -- internals ---------------------------------------------------------------------------
    def _local(self, output: torch.Tensor, input: torch.Tensor, then: Callable[[], object] | None) -> Pending:
        # One rank: every collective is the identity; only the copy (if not in place) remains.
        if output.data_ptr() != input.data_ptr() or output.numel() != input.numel():
            output.copy_(input)
        if then is not None:
            then()
        return Pending(keep=(output, input))

    def _issue(
        self,
        collective: Callable[[torch.Tensor, torch.Tensor], Any],
        output: torch.Tensor,
        input: torch.Tensor,
        then: Callable[[], object] | None,
    ) -> Pending:
        if not self.is_cuda:
            return Pending(work=collective(output, input), then=then, keep=(output, input))
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self.host_staged:
                # Host staging: synchronous by construction (gloo waits on the host).
                h_in = input.to("cpu")
                h_out = h_in if output is input else torch.empty(output.shape, dtype=output.dtype)
                collective(h_out, h_in).wait()
                output.copy_(h_out)
            else:
                work = collective(output, input)
                # NCCL: make the communication stream (not the host) wait for the collective.
                work.wait()
            if then is not None:
                then()
            event = torch.cuda.Event()
            event.record(self.stream)
        return Pending(event=event, keep=(output, input))

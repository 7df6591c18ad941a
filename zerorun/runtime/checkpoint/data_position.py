"""Where the engine's own data loader stopped, so a resumed run does not see a batch twice.

`zerorun.initialize(training_data=dataset)` builds the loader (a `DistributedSampler` over the
dataset, DeepSpeed's behaviour); that loader is a `ResumableLoader`: it counts the batches it
handed out in the current pass, and a checkpoint records the sampler's epoch and the samples
consumed in that pass (over all ranks). A resumed run sets the epoch back and starts its next
pass after those samples: at the same world size exactly where the interrupted run stopped;
at another world size after as many samples (the order of a `DistributedSampler` depends on
the world size, so there is no "same place" to go back to).

A DataLoader the script builds itself is the script's to position (`engine.global_samples` and
`engine.global_steps` say how far training got): zerorun does not know how it is iterated.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ResumableLoader", "ResumableSampler"]


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """A `DistributedSampler` whose next pass may start after its first `skip` indices."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0

    def skip_next(self, n: int) -> None:
        self._skip = max(0, n)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        it = super().__iter__()
        for _ in range(skip):
            if next(it, None) is None:
                break
        return it


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """The DataLoader `zerorun.initialize` builds: counts the batches of the current pass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip_batches = 0
        self.resume_skip = 0  # batches the next pass skips (set by a checkpoint load)
        self.batches_this_pass = 0  # batches handed out since the current pass began

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._skip_batches = self._skip_batches, 0
        sampler = self.sampler
        if skip and isinstance(sampler, ResumableSampler):
            sampler.skip_next(skip * int(self.batch_size or 1))
        self.batches_this_pass = skip
        self.resume_skip = 0
        for batch in super().__iter__():
            self.batches_this_pass += 1
            yield batch

    def position(self, world_size: int) -> dict[str, int]:
        """What a checkpoint records: the sampler's epoch and the samples consumed in this pass
        by all ranks together."""
        epoch = int(getattr(self.sampler, "epoch", 0))
        return {"epoch": epoch, "samples": self.batches_this_pass * int(self.batch_size or 1) * world_size}

    def resume_at(self, position: dict[str, Any], world_size: int) -> int:
        """Continue after `position` (from `position()`, any world size); returns the batches
        this rank skips at the start of its next pass."""
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(int(position.get("epoch", 0)))
        per_batch = int(self.batch_size or 1) * world_size
        self._skip_batches = self.resume_skip = int(position.get("samples", 0)) // per_batch
        return self._skip_batches

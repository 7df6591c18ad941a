"""`zerorun:` -- runtime options DeepSpeed has no key for.

Runtime engineers add their options here (one field each, with a default and a description:
the configuration reference is generated from these).
"""

from __future__ import annotations

from pydantic import create_model

from zerorun.config.types import Count, Flag, NonNegReal, Real, field
from zerorun.config.zero_section import Section

__all__ = ["CheckpointSection", "ZerorunSection"]


class _CheckpointKeys(Section):
    """Where and when the runtime saves and resumes by itself (docs/fault-tolerance.md); DeepSpeed's own `checkpoint` section keeps its meaning."""

    dir: str | None = field(
        None,
        "Directory of the job's checkpoints: periodic saves go here, and `auto_resume` loads its `latest`. "
        "Unset: the launcher's `--resume_from` directory, if given.",
    )
    auto_resume: Flag = field(
        False,
        "`zerorun.initialize` loads `latest` from `dir` when there is one (any world size and stage), before "
        "returning the engine: steps, scheduler, RNG and the engine's data loader position continue.",
    )
    every_n_steps: Count = field(
        0, "Save a checkpoint from `engine.step()` every N optimizer steps (0: only when the script saves).", ge=0
    )
    keep_last: Count = field(
        0, "Keep the newest N `global_step*` checkpoints in `dir`, deleting older ones after a save (0: keep all).", ge=0
    )


# `async` is a Python keyword: the field is declared through create_model (read it with
# getattr(section, "async")).
CheckpointSection = create_model(
    "CheckpointSection",
    __base__=_CheckpointKeys,
    __doc__=_CheckpointKeys.__doc__,
    **{
        "async": (
            Flag,
            field(
                False,
                "Periodic saves are asynchronous: the step stalls only while this rank's shards are copied to "
                "host memory; a background thread writes, fsyncs and commits `latest` once every rank's part is "
                "durable (at most one save in flight).",
            ),
        )
    },
)


class ZerorunSection(Section):
    """zerorun's own runtime options."""

    checkpoint: CheckpointSection = field(  # type: ignore[valid-type]
        default_factory=CheckpointSection,
        description="Periodic / asynchronous checkpoints and automatic resume (docs/fault-tolerance.md).",
    )
    memory_report_interval: Real = field(
        5.0, "Seconds between memory reports a rank sends to the launcher (0 disables the periodic report).", ge=0
    )
    stage3_group_modules: list[str] | None = field(
        None,
        "Stage 3: class names of the modules that form parameter groups (one all-gather each), e.g. "
        "`[GPTBlock]`. Unset: every element of a repeated-block ModuleList/Sequential, plus the root.",
        stages=(3,),
    )
    stage3_group_min_numel: Count = field(
        0,
        "Stage 3: instead of class names, make every module whose not-yet-grouped parameters reach this "
        "many elements a group (bottom-up, like FSDP's size policy). 0: off.",
        stages=(3,),
        ge=0,
    )
    stage3_reshard_after_forward: Flag = field(
        True,
        "Stage 3: release a group's gathered parameters after its forward (false: keep them until its "
        "backward, trading memory for one all-gather less per group and step).",
        stages=(3,),
    )
    stage3_check_order: Flag = field(
        False,
        "Stage 3 debug: compare the order in which groups are gathered across ranks every step and raise, "
        "naming the modules, when ranks diverge (one small all-gather per forward and backward).",
        stages=(3,),
    )
    delayed_param_update: Flag = field(
        False,
        "One-step delayed parameter update (ZeRO-Offload's DPU), with `offload_optimizer` on cpu or nvme: the CPU "
        "optimizer step of step t runs while step t+1's forward/backward runs on parameters one update old. "
        "Faster; changes the math (docs/offload.md).",
    )
    delayed_param_update_warmup: Count = field(
        40,
        "Optimizer steps taken without the delay before `delayed_param_update` starts. 40 by default: with "
        "the delay from the first step a 1.3B GPT trailed the exact run by 4.5 % (mean loss of the last 20 of "
        "60 steps); after 40 exact steps it was within 1 % (benchmarks/results/dpu, docs/offload.md).",
        ge=0,
    )
    offload_gpu_budget_gb: NonNegReal = field(
        0.0,
        "GPU memory (GB, 1e9 bytes) per rank that `offload_optimizer.ratio: \"auto\"` may fill with fp32 master and "
        "optimizer-state shards; the rest goes to the host (docs/offload.md, Twin-Flow). Required by `\"auto\"`.",
        stages=(1, 2, 3),
    )
    offload_cpu_threads: Count = field(
        0,
        "Threads of the CPU optimizer step per rank with optimizer offload; 0: the rank's cores -- its own affinity "
        "(a scheduler's binding), or the node's cores divided by its ranks when they share them (one fewer when the "
        "step overlaps the training loop -- `delayed_param_update`, or no clipping -- leaving it a core).",
        ge=0,
    )

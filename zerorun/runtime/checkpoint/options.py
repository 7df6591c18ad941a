"""What the runtime does about checkpoints by itself: one frozen object, read once.

Built from ``RuntimeSettings.checkpoint`` (the config's `zerorun.checkpoint`, read once in
runtime/settings.py) and the launcher's variables (Contract 2): ``ZERORUN_RESUME_FROM`` (``zerorun --resume_from PATH``) and
``ZERORUN_SAVE_ON_PREEMPTION`` (``zerorun --save_on_preemption``). The engine's periodic saves,
the automatic resume and the preemption handling (`periodic.py`) read only this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from zerorun.config.rules import checkpoint_dir_problems
from zerorun.errors import RuntimeConfigError
from zerorun.runtime.settings import CheckpointSettings

__all__ = ["CheckpointOptions", "checkpoint_options", "RESUME_ENV", "PREEMPTION_ENV", "PREEMPTED_EXIT_CODE"]

RESUME_ENV = "ZERORUN_RESUME_FROM"
PREEMPTION_ENV = "ZERORUN_SAVE_ON_PREEMPTION"
# A rank (and the launcher) that stopped for a preemption after saving exits with this code:
# EX_TEMPFAIL, "try again later" -- distinct from a failure, from 128+SIGTERM and from 0.
PREEMPTED_EXIT_CODE = 75


@dataclass(frozen=True)
class CheckpointOptions:
    dir: str | None  # zerorun.checkpoint.dir
    auto_resume: bool
    every_n_steps: int
    keep_last: int
    async_save: bool  # zerorun.checkpoint.async
    resume_from: str | None  # the launcher's --resume_from
    save_on_preemption: bool  # the launcher's --save_on_preemption

    @property
    def save_dir(self) -> str | None:
        """Where periodic and preemption saves go: `dir`, else the --resume_from directory."""
        return self.dir or self.resume_from

    @property
    def load_dir(self) -> str | None:
        """Where `zerorun.initialize` looks for `latest`: --resume_from, else `dir` with auto_resume."""
        if self.resume_from:
            return self.resume_from
        return self.dir if self.auto_resume else None

    @property
    def active(self) -> bool:
        """Whether the engine has anything to do at step boundaries."""
        return self.every_n_steps > 0 or self.save_on_preemption


def checkpoint_options(settings: CheckpointSettings, env: Mapping[str, str] | None = None) -> CheckpointOptions:
    """The checkpoint settings + the launcher's variables -> CheckpointOptions."""
    env = os.environ if env is None else env
    opts = CheckpointOptions(
        dir=settings.dir,
        auto_resume=settings.auto_resume,
        every_n_steps=settings.every_n_steps,
        keep_last=settings.keep_last,
        async_save=settings.async_save,
        resume_from=env.get(RESUME_ENV) or None,
        save_on_preemption=env.get(PREEMPTION_ENV) == "1",
    )
    # load_config's rules and the launcher's check of its flags report this before any rank
    # starts; reached here by --save_on_preemption when the launcher had no config (the script
    # passes its own to zerorun.initialize), or a ZERORUN_SAVE_ON_PREEMPTION set by hand.
    problems = checkpoint_dir_problems(
        dir=opts.dir,
        resume_from=opts.resume_from,
        auto_resume=opts.auto_resume,
        every_n_steps=opts.every_n_steps,
        save_on_preemption=opts.save_on_preemption,
    )
    if problems:
        raise RuntimeConfigError(problems[0])
    return opts

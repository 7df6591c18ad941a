"""The subcommands of `zerorun` (`zerorun NAME ...`): name -> (module, one-line help).

A table of its own, read by the dispatcher (`zerorun.cli.main`) and by the launch command's
help, which lists them; neither imports the other for it. Each module exposes
`app: typer.Typer` (a single command) and is imported only when its command runs.
"""

from __future__ import annotations

__all__ = ["SUBCOMMANDS", "ALIASES"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "print-config": ("zerorun.cli.config_cmds", "Validate a config and print the resolved settings."),
    "estimate": ("zerorun.cli.estimate_cmd", "Estimate per-GPU / per-host memory of model states."),
    "env": ("zerorun.cli.env_cmd", "Report versions, GPUs and environment for bug reports."),
    "consolidate": ("zerorun.cli.consolidate_cmd", "Build a full state dict from a sharded checkpoint."),
    "sbatch": ("zerorun.cli.sbatch_cmd", "Write and submit a Slurm batch script running the same zerorun command."),
    "plot": ("zerorun.cli.plot_cmd", "Plot a run's loss, lr, throughput and memory as a PNG."),
    "compat": ("zerorun.cli.compat_cmd", "install|uninstall|status: this venv's `import deepspeed`/`deepspeed` as zerorun's."),
}
# DeepSpeed users type underscores.
ALIASES = {"print_config": "print-config"}

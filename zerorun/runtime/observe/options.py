"""What the user asked to see, as small frozen objects (read once from the validated config).

``ObserveOptions.from_config(cfg)`` is the only reader of this package's config keys:
`steps_per_print`, `wall_clock_breakdown`, `flops_profiler`, and the monitor sections
`tensorboard`, `wandb`, `csv_monitor`, `comet` (zerorun/config/observe_sections.py, where the
defaults live). Downstream code reads attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerorun.config.observe_sections import MONITOR_EXTRAS

if TYPE_CHECKING:
    from zerorun.config.schema import ZerorunConfig

__all__ = ["MONITOR_SECTIONS", "FlopsProfilerOptions", "MonitorOptions", "ObserveOptions"]

# The monitor sections: csv_monitor needs only the standard library; the others' packages are
# the config's MONITOR_EXTRAS (checked there when the config is loaded).
MONITOR_SECTIONS: tuple[str, ...] = ("csv_monitor", *MONITOR_EXTRAS)


@dataclass(frozen=True)
class MonitorOptions:
    """One enabled monitor section. tensorboard and csv_monitor write under
    `output_path/job_name` (DeepSpeed's layout; an empty path is the rank's working directory).
    `params`: the section's other keys (wandb's project/team/group, comet's)."""

    backend: str
    output_path: str
    job_name: str
    params: dict[str, Any]


@dataclass(frozen=True)
class FlopsProfilerOptions:
    enabled: bool
    profile_step: int
    module_depth: int
    top_modules: int
    detailed: bool
    output_file: str | None
    recompute_fwd_factor: float


@dataclass(frozen=True)
class ObserveOptions:
    steps_per_print: int
    wall_clock_breakdown: bool
    monitors: tuple[MonitorOptions, ...]
    flops_profiler: FlopsProfilerOptions

    @classmethod
    def from_config(cls, cfg: ZerorunConfig) -> ObserveOptions:
        monitors = []
        for name in MONITOR_SECTIONS:
            section = getattr(cfg, name)
            if not section.enabled:
                continue
            data = section.model_dump()
            monitors.append(
                MonitorOptions(
                    backend=name,
                    output_path=str(data.pop("output_path", None) or ""),
                    job_name=str(data.pop("job_name", None) or "DeepSpeedJobName"),
                    params={k: v for k, v in data.items() if k != "enabled"},
                )
            )
        fp = cfg.flops_profiler
        return cls(
            steps_per_print=cfg.steps_per_print,
            wall_clock_breakdown=cfg.wall_clock_breakdown,
            monitors=tuple(monitors),
            flops_profiler=FlopsProfilerOptions(
                enabled=fp.enabled,
                profile_step=fp.profile_step,
                module_depth=fp.module_depth,
                top_modules=fp.top_modules,
                detailed=fp.detailed,
                output_file=fp.output_file,
                recompute_fwd_factor=float(fp.recompute_fwd_factor),
            ),
        )

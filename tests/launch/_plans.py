"""A small launch plan for the pure launcher tests (no processes)."""

from __future__ import annotations

from zerorun.launch.hosts import Host, local_hosts
from zerorun.launch.plan import DeviceInfo, LaunchOptions, LaunchPlan, Target, build_plan

CPU = DeviceInfo(gpus=(), cores=8)
TARGET = Target(script="train.py", args=("--lr", "1"))


def plan_for(hosts: list[Host] | None = None, devices: DeviceInfo = CPU, **kw: object) -> LaunchPlan:
    opts = LaunchOptions(target=TARGET, **kw)  # type: ignore[arg-type]
    return build_plan(opts, hosts or local_hosts(2), devices, master_port=29500, run_id="rid")

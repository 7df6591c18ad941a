"""`launcher:` -- zerorun's own section: the launch options one YAML file can carry.

Everything here can also be given on the command line, and the command line wins. Unset
values (None) mean "not given here": the command line or the launcher's own default decides,
so this section never hides a default of its own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from zerorun.config.types import Count, EnvValue, Real, field
from zerorun.config.zero_section import Section

__all__ = ["LauncherSection"]


class LauncherSection(Section):
    """Launch options (`zerorun [options] SCRIPT`); flags on the command line override them."""

    num_gpus: Count | None = field(None, "Ranks per node (GPUs per node, or CPU ranks on a CPU machine).", ge=1)
    num_nodes: Count | None = field(None, "Number of nodes to use from the hostfile.", ge=1)
    hostfile: str | None = field(None, "DeepSpeed-format hostfile (`host slots=N` lines); relative to the config file.")
    include: str | None = field(None, "Hosts/slots to use, DeepSpeed syntax: `worker-1:0,1@worker-2`.")
    exclude: str | None = field(None, "Hosts/slots to leave out, same syntax as include.")
    master_addr: str | None = field(None, "Address ranks use to reach rank 0 (default: the first host).")
    master_port: Count | None = field(None, "TCP port of the rendezvous on the master (default: a free port).", ge=1, le=65535)
    device: Literal["cuda", "cpu"] | None = field(None, "Run ranks on `cuda` or `cpu` (default: cuda when GPUs are present).")
    ranks_per_gpu: Count = field(1, "Ranks sharing one GPU (testing several ranks on one GPU; forces gloo).", ge=1)
    pg_timeout: Real | None = field(None, "Process-group timeout in seconds, given to torch.distributed.", gt=0)
    hang_timeout: Real | None = field(
        None, "Seconds without any output or event from a rank before the launcher reports a hang.", gt=0
    )
    env: dict[str, EnvValue] = field(
        default_factory=dict, description="Environment variables for every rank (values are strings, as written)."
    )
    host_env: dict[str, dict[str, EnvValue]] = field(
        default_factory=dict,
        description="Per-host environment variables, e.g. `{worker-2: {GLOO_SOCKET_IFNAME: eth1}}`.",
    )
    log_dir: str | None = field(None, "Directory for per-rank log files (none when unset).")
    # The names `--launcher` takes too (launch/selection.py's LAUNCHERS; a test keeps them equal).
    launcher: Literal["auto", "local", "ssh", "slurm", "mpi", "pernode", "sim"] | None = field(
        None,
        "How nodes are started: `auto` (default: the scheduler or hostfile decides, see docs/clusters.md), "
        "`local`, `ssh`, `slurm`, `mpi` (mpirun starts the hostfile's nodes), `pernode` (one zerorun per "
        "node: Kubernetes, srun per node) or `sim` (the hostfile's nodes simulated on this machine, the "
        "script not run: docs/multinode.md).",
    )
    rdzv_timeout: Real | None = field(
        None, "Per-node mode: seconds node 0 waits for every node to join (default 300).", gt=0
    )
    deepspeed_compat: bool | None = field(
        None,
        "`import deepspeed` in the ranks resolves to zerorun's DeepSpeed compatibility layer, and every "
        "script gets `--local_rank=N` (as `zerorun --deepspeed-compat`).",
    )

    max_restarts: Count | None = field(
        None, "Restart the job up to N times after a retryable failure (`--max_restarts`; docs/fault-tolerance.md).", ge=0
    )
    restart_on_any_failure: bool | None = field(
        None, "Also restart after an exception every rank raised before the first optimizer step (`--restart_on_any_failure`)."
    )
    resume_from: str | None = field(
        None, "Every rank loads the latest checkpoint of this directory, if any (`--resume_from`); relative to the config file."
    )
    save_on_preemption: bool | None = field(
        None, "On SIGTERM the ranks save a checkpoint at their next step boundary and exit with code 75 (`--save_on_preemption`)."
    )
    preemption_grace: Real | None = field(
        None, "Seconds the ranks get to save after SIGTERM with `save_on_preemption` (default 25).", gt=0
    )
    exclude_failed_nodes: bool | None = field(
        None, "With `max_restarts` and a hostfile: a node lost, or whose ranks died of a signal, is left out of the next attempt."
    )
    min_nodes: Count | None = field(None, "With `exclude_failed_nodes`: no restart with fewer nodes than this (default 1).", ge=1)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        _check_env_names(value)
        return value

    @field_validator("host_env")
    @classmethod
    def _host_env_names(cls, value: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        for env in value.values():
            _check_env_names(env)
        return value


def _check_env_names(env: dict[str, str]) -> None:
    for name in env:
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name):
            raise ValueError(f"{name!r} is not a valid environment variable name (letters, digits, _; not starting with a digit)")

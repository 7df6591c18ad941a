"""Restarts: run the job again after a failure that another attempt can get past.

`run_with_restarts(options)` wraps `launch.job.run_job`: with ``--max_restarts N`` (or
``launcher.max_restarts``; 0, the default, is one attempt and today's behaviour) a failed
attempt is classified (`classify`), and a retryable one starts the job again from scratch --
same options, a new run id, a new master port unless the user fixed one that is still free --
at most N times. The ranks resume by themselves when the config asks for it
(``zerorun.checkpoint.auto_resume`` or ``--resume_from``; docs/fault-tolerance.md).

What is retried: a rank killed by a signal (OOM killer, a GPU that fell off the bus, a
``kill -9``), a lost node or agent, a hang stopped by ``--hang_timeout``, and exceptions that
name a collective/communication failure. What is not: the same Python exception raised on
every rank that reported one, before any rank finished its first optimizer step (a setup or
config error that would fail again; ``--restart_on_any_failure`` retries it anyway), a launcher
interrupted by Ctrl-C, and a preemption (exit 75: the next submission resumes). Every other
failure is retried.

With ``--exclude_failed_nodes`` (a hostfile job), a node that was lost or whose ranks died of a
signal is left out of the next attempt (an `--include` selector loses it, an `--exclude` gains
it; with `--num_nodes` a spare host of the hostfile takes its place), as long as
``--min_nodes`` (default 1) remain. The ranks resume at the smaller world size (checkpoints
load at any world size). The batch triad is resolved again for it (`config.batch.rebatch`): the
micro batch stays, `train_batch_size` is kept when it divides (the accumulation steps change),
else it changes; the launcher says which on the console, the ranks get it as ZERORUN_BATCH, and
summary.json records it with the attempt.

An attempt that cannot start (its checks or the nodes' preflight raise before any rank runs) is
a failed attempt too, recorded with reason ``not_started``, the error, and the error's exit code:
on a restart a `LaunchError` (a node still rebooting or unreachable, a port still held) is
retried after a wait (``ZERORUN_RESTART_WAIT`` seconds, default 10, doubling for each such
attempt in a row, at most 120); a config or hostfile error, too few nodes left to select, or any error of the first
attempt (the user's setup) ends the job with that error, as without restarts.

With N > 0 and ``--log_dir DIR``: attempt k writes its files to ``DIR/attempt{k}/`` and
``DIR/summary.json`` lists every attempt (exit code, reason, classification) and the final
exit code -- the last attempt's.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zerorun.errors import ConfigError, HostfileError, LaunchError, ZerorunError
from zerorun.launch.plan import LaunchOptions
from zerorun.launch.result import PREEMPTED_EXIT_CODE, JobResult, describe_exit, where

__all__ = [
    "Attempt",
    "classify",
    "classify_start_failure",
    "run_with_restarts",
    "budget_message",
    "with_config_section",
    "failed_nodes",
    "without_nodes",
]

# Exception texts of a failed collective or a peer that went away: the failure is elsewhere
# (a rank that died, a flaky link), so another attempt may succeed.
_TRANSIENT = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl",
    "gloo",
    "distbackenderror",
    "cuda error",
    "ecc error",
)


@dataclass(frozen=True)
class Attempt:
    number: int
    exit_code: int
    reason: str
    message: str
    retry: bool  # whether the failure was one to retry (True for the last one too, when the budget ran out)
    why: str  # the classification, in words
    log_dir: str | None
    world_size: int | None = None  # None: the attempt did not start
    batch: str | None = None  # how the batch triad changed for this attempt's world size, if it did

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "message": self.message,
            "retryable": self.retry,
            "why": self.why,
            "log_dir": self.log_dir,
            "world_size": self.world_size,
            "batch": self.batch,
        }


def _reached_first_step(result: JobResult) -> bool:
    """Whether any rank reported finishing an optimizer step (the engine's `status` events)."""
    for state in result.ranks:
        step = (state.status or {}).get("step")
        if isinstance(step, (int, float)) and step >= 1:
            return True
    return False


def classify(result: JobResult, *, restart_on_any_failure: bool = False) -> tuple[bool, str]:
    """(retry?, why) for a finished attempt. Pure."""
    if result.exit_code == 0:
        return False, "finished"
    if result.reason == "preempted" or result.exit_code == PREEMPTED_EXIT_CODE:
        return False, "preempted (the checkpoint is saved; the next submission resumes)"
    if result.reason == "interrupted":
        return False, f"the launcher was interrupted ({result.message})"
    if result.reason == "node_lost":
        return True, f"lost node: {result.message}"
    if result.reason == "hang":
        return True, f"hang: {result.message}"
    first = next((s for s in result.ranks if s.rank == result.first_failure), None)
    if first is not None and first.returncode is not None and first.returncode < 0:
        return True, f"rank {where(first.spec)} was killed ({describe_exit(first.returncode)})"
    errors = [(s, s.error) for s in result.ranks if s.error]
    texts = [f"{e.get('type')}: {e.get('message')}" for _, e in errors]
    if any(any(t in text.lower() for t in _TRANSIENT) for text in texts):
        return True, f"a communication failure: {texts[0][:300]}"
    if errors and len(set(texts)) == 1 and not _reached_first_step(result):
        silent = [s for s in result.ranks if not s.error and s.state not in ("stopped", "exited")]
        if not silent:
            why = (
                f"{texts[0][:300]} raised on every rank that reported an error, before the first optimizer step "
                "(a setup or config error would fail again)"
            )
            if restart_on_any_failure:
                return True, why + "; retried (--restart_on_any_failure)"
            return False, why + "; not retried (--restart_on_any_failure retries it)"
    if first is not None and first.error:
        return True, f"rank {where(first.spec)} failed: {texts[0][:300]}"
    code = describe_exit(first.returncode) if first is not None and first.returncode is not None else f"exit {result.exit_code}"
    return True, f"rank {where(first.spec) if first is not None else '?'} failed ({code})"


def classify_start_failure(err: ZerorunError, *, restart: bool) -> tuple[bool, str]:
    """(retry?, why) for an attempt that raised before any rank started. Pure.

    A restart whose preflight fails (a node still rebooting or unreachable, its agent not
    answering, a port still held there: `LaunchError`) is retried like a failed attempt. A
    config or hostfile error, or too few nodes left to select, would fail the same way again; so
    would anything on the first attempt (today's behaviour: the user's setup)."""
    text = str(err).rstrip(".")
    if not restart:
        return False, f"could not start: {text}"
    if isinstance(err, (ConfigError, HostfileError)) or not isinstance(err, LaunchError):
        return False, f"could not start: {text} (it would fail the same way again)"
    return True, f"could not start: {text}"


# Seconds before retrying an attempt that could not start (doubling per such attempt in a row,
# capped): ZERORUN_RESTART_WAIT in the launcher's environment.
_START_RETRY_WAIT_S = 10.0
_START_RETRY_WAIT_MAX_S = 120.0


def _start_retry_wait() -> float:
    from zerorun.launch.knobs import env_number

    value = env_number(("ZERORUN_RESTART_WAIT",), _START_RETRY_WAIT_S)
    assert value is not None
    return value


def budget_message(attempts: list[Attempt], max_restarts: int) -> str:
    """The final line when every attempt failed: each attempt's failure, by number."""
    lines = "; ".join(f"attempt {a.number}: {a.why}" for a in attempts)
    return f"the job failed {len(attempts)} time(s); restart budget of {max_restarts} exhausted -- {lines}"


def _write_summary(log_dir: Path, attempts: list[Attempt], max_restarts: int, final: int) -> None:
    data = {
        "max_restarts": max_restarts,
        "attempts": [a.to_json() for a in attempts],
        "exit_code": final,
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "summary.json").write_text(json.dumps(data, indent=2) + "\n")


def _say(text: str) -> None:
    sys.stderr.write(f"zerorun: {text}\n")
    sys.stderr.flush()


# What the loop itself reads: the restart settings, and what it changes or checks between
# attempts (the node selection, the master port, the transport). Merging these here changes
# nothing for run_job, which merges the same section under the same values again.
_LOOP_KEYS = (
    "max_restarts", "restart_on_any_failure", "log_dir", "exclude_failed_nodes", "min_nodes",
    "hostfile", "include", "exclude", "master_port", "launcher",
)  # fmt: skip


def _config_path(options: LaunchOptions) -> str | None:
    """The config run_job will load (--config, else the script's --deepspeed_config-style
    argument), when it exists."""
    from zerorun.launch.target import find_config_argument

    path = options.config
    if path is None:
        found = find_config_argument(options.target.args)
        path = found[1] if found is not None else None
    return path if path is not None and Path(path).is_file() else None


def with_config_section(options: LaunchOptions) -> LaunchOptions:
    """`options` with the settings of the config's `launcher:` section that the restart loop
    reads filled in where the command line left them out (a hostfile or an `include` given only
    in the config must be the one failed nodes are left out of); the rest is run_job's business."""
    path = _config_path(options)
    if path is None:
        return options  # no config, or run_job reports the missing file
    from zerorun.config import load_config

    section = load_config(path, resume_from=options.resume_from).config.launcher.model_dump(exclude_unset=True)
    subset = {k: v for k, v in section.items() if k in _LOOP_KEYS}
    return options.merged(subset, base_dir=Path(path).resolve().parent)


def failed_nodes(result: JobResult) -> list[str]:
    """Hosts an attempt lost: nodes lost (connection or agent gone) and nodes whose ranks died of
    a signal -- not ranks the launcher stopped, nor Python exceptions (a bad node does not
    raise). In node order."""
    hosts: list[str] = []
    for s in result.ranks:
        dead = s.state == "lost" or (s.state == "failed" and s.returncode is not None and s.returncode < 0)
        if dead and s.spec.host not in hosts:
            hosts.append(s.spec.host)
    return hosts


def without_nodes(options: LaunchOptions, hosts: list[str]) -> LaunchOptions:
    """`options` selecting the same hosts minus `hosts` (DeepSpeed's selector syntax: an
    `--include` loses their entries, otherwise they join `--exclude`)."""
    if options.include:
        keep = [part for part in options.include.split("@") if part and part.split(":")[0] not in hosts]
        return replace(options, include="@".join(keep))
    parts = [part for part in (options.exclude or "").split("@") if part]
    return replace(options, exclude="@".join(parts + [h for h in hosts if h not in parts]))


def _single_machine(options: LaunchOptions) -> bool:
    """Whether this launcher alone picks the master port: a job on this machine only. With a
    hostfile the preflight checks the port on the master; in per-node mode and under Slurm the
    nodes must agree on it, so it is never changed here."""
    if options.hostfile is not None or options.nnodes is not None or options.launcher not in (None, "auto", "local"):
        return False
    return options.launcher == "local" or not any(k in os.environ for k in ("SLURM_JOB_ID", "SLURM_JOBID"))


def run_with_restarts(
    options: LaunchOptions,
    *,
    run_job: Callable[[LaunchOptions], JobResult] | None = None,
    port_is_free: Callable[[int], bool] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Run the job, restarting it as `classify` says, at most `options.max_restarts` times (the
    command line's, else the config's); the exit code of the last attempt."""
    if run_job is None:
        from zerorun.launch.job import run_job as run_job_default

        run_job = run_job_default
    options = with_config_section(options)
    if port_is_free is None:
        from zerorun.launch.local import port_is_free as port_is_free_default

        port_is_free = port_is_free_default
    max_restarts = options.max_restarts or 0
    if options.exclude_failed_nodes and options.hostfile is None:
        raise LaunchError("--exclude_failed_nodes needs --hostfile (it leaves failed nodes of the hostfile out of the next attempt).")
    if max_restarts <= 0:
        return run_job(options).exit_code
    total = max_restarts + 1
    root = Path(options.log_dir) if options.log_dir is not None else None
    attempts: list[Attempt] = []
    result: JobResult | None = None
    current = options
    first_world: int | None = None  # the world size of the first attempt
    for number in range(1, total + 1):
        # A later attempt at another world size re-resolves the batch triad (run_job says how).
        attempt_opts = replace(current, run_id=None, batch_world_size=first_world)
        if root is not None:
            attempt_opts = replace(attempt_opts, log_dir=str(root / f"attempt{number}"))
        if number > 1 and options.master_port is not None and _single_machine(options) and not port_is_free(options.master_port):
            _say(f"--master_port {options.master_port} is still held; attempt {number} uses a free port")
            attempt_opts = replace(attempt_opts, master_port=None)
        _say(f"attempt {number}/{total}" + (" (restart)" if number > 1 else ""))
        try:
            result = run_job(attempt_opts)
        except ZerorunError as err:
            # This attempt could not start. The first attempt's reasons are the user's setup, as
            # without restarts; on a restart it is a failed attempt like any other.
            retry, why = classify_start_failure(err, restart=number > 1)
            attempts.append(Attempt(number, err.exit_code, "not_started", str(err), retry, why, attempt_opts.log_dir))
            if root is not None:
                _write_summary(root, attempts, max_restarts, err.exit_code)
            if retry and number < total:
                # A node that is rebooting or unreachable needs a moment: an immediate retry
                # would spend the budget in seconds. Longer after each attempt that could not start.
                unstarted = len(list(itertools.takewhile(lambda a: a.reason == "not_started", reversed(attempts))))
                wait = min(_start_retry_wait() * 2 ** (unstarted - 1), _START_RETRY_WAIT_MAX_S)
                _say(f"attempt {number}/{total} {why}; restarting in {wait:g} s")
                try:
                    sleep(wait)
                except KeyboardInterrupt:
                    # Ctrl-C while waiting: no rank runs, so stop here (as during an attempt:
                    # 130), not with the CLI's "interrupted before the job started".
                    _say(f"interrupted while waiting to restart; attempt {number + 1}/{total} not started")
                    if root is not None:
                        _write_summary(root, attempts, max_restarts, 130)
                    return 130
                continue
            if number > 1:
                _say(budget_message(attempts, max_restarts) if retry else f"attempt {number}/{total} {why}; not retried")
            raise  # the CLI reports the error and exits with its code, the one summary.json has
        world = len(result.ranks)
        if first_world is None:
            first_world = world
        retry, why = classify(result, restart_on_any_failure=bool(options.restart_on_any_failure))
        lost = failed_nodes(result) if retry and options.exclude_failed_nodes else []
        if lost:
            nodes = len({s.spec.host for s in result.ranks})
            left = nodes - len(lost)
            why += f"; leaving out {', '.join(lost)} ({left} node(s) left)"
            if left < (options.min_nodes or 1):
                retry = False
                why += f", fewer than --min_nodes {options.min_nodes or 1}"
        attempts.append(
            Attempt(
                number, result.exit_code, result.reason, result.message, retry, why, attempt_opts.log_dir, world,
                result.batch_note,
            )
        )
        if root is not None:
            _write_summary(root, attempts, max_restarts, result.exit_code)
        if result.exit_code == 0:
            if number > 1:
                _say(f"attempt {number}/{total} finished; earlier: " + "; ".join(f"attempt {a.number}: {a.why}" for a in attempts[:-1]))
            return 0
        if not retry:
            _say(f"attempt {number}/{total} failed and is not retried: {why}")
            return result.exit_code
        if number < total:
            _say(f"attempt {number}/{total} failed: {why}; restarting")
            if lost:
                current = without_nodes(current, lost)
    assert result is not None
    _say(budget_message(attempts, max_restarts))
    return result.exit_code

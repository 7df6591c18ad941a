"""The launcher at 8 to 1,000 nodes x 8 ranks, by simulation (`zerorun/launch/simulate.py`). Not a test.

    .venv/bin/python -m benchmarks.launcher_scale startup    [--nodes 8,64,256,1000] [--latency 0.05] [--parallelism 32]
    .venv/bin/python -m benchmarks.launcher_scale throughput [--nodes 1000] [--rate 1] [--seconds 60]
    .venv/bin/python -m benchmarks.launcher_scale failfast   [--nodes 8,64,256,1000]
    .venv/bin/python -m benchmarks.launcher_scale silent     [--nodes 1000]
    .venv/bin/python -m benchmarks.launcher_scale ssh        [--connections 64]   (root: starts a private sshd on loopback)

Every run goes through the launcher's real code: `simulate.prepare` (bounded connect fan-out
with the injected latency, the preflight on every agent), `Supervisor.run` with the plain
console (to /dev/null) and `--log_dir` (every line of every rank written to disk). Only the
far side is simulated: real node agents with synthetic ranks, many per process. Results are
merged into `benchmarks/results/launcher_scale.json` (one section per command and size), with
the machine's description; the docs quote that file.

What each command measures:
- startup: from `prepare` (zerorun's connect fan-out) to every rank reported running.
- throughput: every rank prints `--rate` lines/s for `--seconds`; the launcher's CPU per line
  (its whole process: link reader, supervisor, console, log files), the lag from a line's
  write (its `t=` stamp, CLOCK_MONOTONIC, the same in every process) to the console, per
  10-second window (bounded = no backlog), and the line rate actually achieved.
- failfast: one rank exits 3 at 2 s; time from the supervisor seeing it to `run()` returning
  with every rank stopped; ranks left alive on the agents afterwards (must be 0).
- silent: one node goes silent (link drop) at 3 s; time until the launcher names it, vs the
  10 s heartbeat timeout.
- ssh: `--connections` real SSH connections (paramiko) to a private sshd on 127.0.0.1, each
  running the real node agent's preflight: the launcher's CPU seconds, RSS and threads per
  connection, and the wall time; extrapolated to 1,000 nodes at parallelism 64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "launcher_scale.json"
_STAMP = re.compile(r" t=(\d+\.\d+)$")
# The simulated agent hosts run at this niceness: on the shared 2-core machine the launcher (what
# is measured) gets the CPU first; real nodes have CPUs of their own.
_HOST_NICE = 10


# --- measuring console ----------------------------------------------------------------------


class Probe:
    """Wraps the real console: counts lines, samples each line's lag, notes when every rank
    runs and when errors are announced."""

    def __init__(self, inner: Any, *, sample_every: int = 8) -> None:
        self.inner = inner
        self.sample_every = sample_every
        self.states: Sequence[Any] = ()
        self.lines = 0
        self.stamped = 0
        self.lags: list[tuple[float, float]] = []  # (arrival, lag)
        self.all_running_at: float | None = None
        self.notes: list[tuple[float, str, str]] = []
        self._next_check = 0.0
        self._n = 0

    def begin(self, plan: Any, states: Sequence[Any]) -> None:
        self.states = states
        self.inner.begin(plan, states)

    def output(self, runs: Sequence[Any]) -> None:
        """Runs of a rank's lines (`RankLines`; a `RankOutput` is a run of one)."""
        now = time.monotonic()
        for run in runs:
            self.lines += len(run.lines)
            for text in run.lines:
                self._n += 1
                if self._n % self.sample_every:
                    continue
                m = _STAMP.search(text)
                if m:
                    self.lags.append((now, now - float(m.group(1))))
        self.inner.output(runs)

    def note(self, text: str, *, level: str = "info") -> None:
        self.notes.append((time.monotonic(), level, text))
        self.inner.note(text, level=level)  # type: ignore[arg-type]

    def refresh(self) -> None:
        now = time.monotonic()
        if self.all_running_at is None and now >= self._next_check:
            self._next_check = now + 0.05  # a scan of every rank's state: not every turn
            if all(s.state != "starting" for s in self.states):
                self.all_running_at = now
        self.inner.refresh()

    def stop(self) -> None:
        self.inner.stop()

    def end(self, result: Any) -> None:
        self.inner.end(result)


def _cpu_of(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m_at_start": round(load[0], 2),
    }


def _save(section: str, key: str, data: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    doc.setdefault("schema", "zerorun-launcher-scale/1")
    runs = doc.setdefault(section, {})
    if key in runs:  # an earlier run of the same case stays, under its date
        old = runs.pop(key)
        runs[f"{key}@{old['date']}"] = old
    runs[key] = {**data, "machine": _machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, RESULTS)
    print(f"{section}[{key}]: {json.dumps(data)}", flush=True)


# --- one simulated job -------------------------------------------------------------------------


def run_sim(nodes: int, ranks: int, scenario: Any, *, parallelism: int, heartbeat_timeout_s: float = 10.0,
            grace: float = 2.0) -> dict[str, Any]:
    from zerorun.launch.console import PlainConsole
    from zerorun.launch.simulate import SimCluster, prepare, sim_plan
    from zerorun.launch.supervisor import Supervisor

    cluster = SimCluster.start(nodes, scenario)
    devnull = open(os.devnull, "w")  # noqa: SIM115
    logs = tempfile.mkdtemp(prefix="zerorun-scale-logs-")
    try:
        plan = sim_plan(nodes, ranks)
        cpu0, t0 = time.process_time(), time.monotonic()
        plan, runners = prepare(plan, cluster, parallelism=parallelism, heartbeat_timeout_s=heartbeat_timeout_s)
        t_prepared = time.monotonic()
        probe = Probe(PlainConsole(out=devnull, err=devnull))
        host_cpu0 = sum(_cpu_of(p.pid) for p in cluster.procs)
        threads = threading.active_count()
        result = Supervisor(plan, runners, probe, grace_period=grace, log_dir=logs).run()
        t_end = time.monotonic()
        cpu_end = time.process_time()
        host_cpu = sum(_cpu_of(p.pid) for p in cluster.procs) - host_cpu0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        totals = cluster.close()
        devnull.close()
        subprocess.run(["rm", "-rf", logs], check=False)
    return {
        "t0": t0, "prepared": t_prepared, "end": t_end, "cpu0": cpu0, "cpu_end": cpu_end,
        "probe": probe, "result": result, "totals": totals, "host_cpu_s": host_cpu, "launcher_threads": threads,
        "launcher_peak_rss": rss, "agent_processes": len(cluster.procs),
    }


def _lag_windows(probe: Probe, start: float, end: float, width: float = 10.0) -> list[dict[str, Any]]:
    out = []
    t = start
    while t < end:
        lags = [lag for at, lag in probe.lags if t <= at < t + width]
        if lags:
            lags.sort()
            out.append({
                "from_s": round(t - start, 1), "samples": len(lags),
                "p50_ms": round(1000 * lags[len(lags) // 2], 2),
                "p99_ms": round(1000 * lags[min(len(lags) - 1, int(len(lags) * 0.99))], 2),
                "max_ms": round(1000 * lags[-1], 2),
            })
        t += width
    return out


# --- commands ----------------------------------------------------------------------------------


def cmd_startup(args: argparse.Namespace) -> None:
    from zerorun.launch.simulate import Scenario

    for nodes in args.nodes:
        sc = Scenario(line_rate=0.5, event_interval_s=2.0, duration_s=args.hold, connect_latency_s=args.latency,
                      host_nice=_HOST_NICE)
        r = run_sim(nodes, args.ranks, sc, parallelism=args.parallelism)
        # When the supervisor handled the last rank's start (each RankState's `started`).
        running = max((st.started for st in r["result"].ranks if st.started is not None), default=None)
        _save("startup", f"{nodes}x{args.ranks}-p{args.parallelism}", {
            "nodes": nodes, "ranks": nodes * args.ranks, "parallelism": args.parallelism,
            "connect_latency_s": args.latency,
            "connect_and_preflight_s": round(r["prepared"] - r["t0"], 3),
            "to_all_running_s": round(running - r["t0"], 3) if running else None,
            "ideal_latency_bound_s": round(-(-nodes // args.parallelism) * args.latency, 3),
            "exit_code": r["result"].exit_code, "ranks_left": r["totals"]["ranks_left"],
            "agent_processes": r["agent_processes"], "launcher_threads": r["launcher_threads"],
        })


def cmd_throughput(args: argparse.Namespace) -> None:
    from zerorun.launch.simulate import Scenario

    for nodes in args.nodes:
        sc = Scenario(line_rate=args.rate, event_interval_s=args.event_interval, duration_s=args.seconds,
                      warn_interval_s=30.0, host_nice=args.host_nice)
        # A long heartbeat timeout: on a machine shared with other work a starved agent host
        # must not end the measurement (heartbeats are measured by `silent`).
        r = run_sim(nodes, args.ranks, sc, parallelism=64, heartbeat_timeout_s=args.heartbeat_timeout)
        probe, result = r["probe"], r["result"]
        running = max((st.started for st in result.ranks if st.started is not None), default=r["prepared"])
        start = running + args.warmup
        end = r["end"] - 1.0
        stamped = [at for at, _ in probe.lags if start <= at < end]
        achieved = len(stamped) * probe.sample_every / max(1e-9, end - start)
        target = nodes * args.ranks * args.rate
        launcher_cpu = r["cpu_end"] - r["cpu0"]
        windows = _lag_windows(probe, start, end)
        p99s = [w["p99_ms"] for w in windows]
        _save("throughput", f"{nodes}x{args.ranks}-r{args.rate:g}-s{args.seconds:g}", {
            "nodes": nodes, "ranks": nodes * args.ranks, "lines_per_rank_s": args.rate, "seconds": args.seconds,
            "target_lines_s": target, "achieved_lines_s": round(achieved, 1),
            "achieved_fraction": round(achieved / target, 3), "counts": achieved >= 0.99 * target,
            "lines_total": probe.lines,
            "launcher_cpu_s": round(launcher_cpu, 2),
            "launcher_cpu_per_line_us": round(1e6 * launcher_cpu / max(1, probe.lines), 2),
            "launcher_cpu_fraction_of_one_core": round(launcher_cpu / (r["end"] - r["t0"]), 3),
            "agent_hosts_cpu_s": round(r["host_cpu_s"], 2), "agent_processes": r["agent_processes"],
            "lag_windows": windows,
            "lag_p99_first_window_ms": p99s[0] if p99s else None, "lag_p99_last_window_ms": p99s[-1] if p99s else None,
            "launcher_peak_rss_mib": round(r["launcher_peak_rss"] / 2**20, 1),
            "launcher_threads": r["launcher_threads"],
            "exit_code": result.exit_code, "ranks_left": r["totals"]["ranks_left"],
            "heartbeat_timeout_s": args.heartbeat_timeout, "agent_hosts_nice": args.host_nice,
            "all_running_after_s": round(running - r["t0"], 2),
        })


def cmd_failfast(args: argparse.Namespace) -> None:
    from zerorun.launch.simulate import Scenario

    for nodes in args.nodes:
        victim = nodes * args.ranks // 2 + 3
        sc = Scenario(line_rate=1.0, event_interval_s=2.0, fail={victim: (2.0, 3)}, host_nice=_HOST_NICE)
        r = run_sim(nodes, args.ranks, sc, parallelism=64)
        result = r["result"]
        # From the supervisor handling the failed rank's exit to it handling the last exit of
        # the ranks it stopped (RankState.ended); then to run() returning (runners closed,
        # every log line written to disk).
        seen = next(st.ended for st in result.ranks if st.rank == victim)
        stopped = max(st.ended for st in result.ranks if st.ended is not None)
        states = {s.state for s in result.ranks}
        unconfirmed = sum(1 for st in result.ranks if st.ended is None)  # no exit reported after the kill
        _save("failfast", f"{nodes}x{args.ranks}", {
            "nodes": nodes, "ranks": nodes * args.ranks, "failed_rank": victim,
            "exit_code": result.exit_code, "first_failure": result.first_failure,
            "failure_to_all_stopped_s": round(stopped - seen, 3),
            "failure_to_launcher_done_s": round(r["end"] - seen, 3),
            "rank_states": sorted(states), "ranks_unconfirmed": unconfirmed, "ranks_left": r["totals"]["ranks_left"],
            "agents_left": r["totals"]["agents_left"],
        })


def cmd_silent(args: argparse.Namespace) -> None:
    from zerorun.launch.simulate import Scenario

    for nodes in args.nodes:
        node = nodes // 3
        # The agents' own heartbeats are what is measured here: their hosts keep normal priority
        # (niced, a host starved by other work froze for longer than the timeout: a real frozen
        # node, but not the one under test), and a light line rate.
        sc = Scenario(line_rate=0.2, event_interval_s=5.0, silent={node: 3.0})
        r = run_sim(nodes, args.ranks, sc, parallelism=64, heartbeat_timeout_s=args.timeout)
        probe, result = r["probe"], r["result"]
        seen = next((at for at, level, _ in probe.notes if level == "error"), None)
        # The node fell silent 3 s after its plan arrived; plans go out right after prepare.
        _save("silent", f"{nodes}x{args.ranks}", {
            "nodes": nodes, "silent_node": f"sim-{node:04d}", "heartbeat_timeout_s": args.timeout,
            "detected_after_silence_s": round(seen - (r["prepared"] + 3.0), 2) if seen else None,
            "message": result.message, "named": f"sim-{node:04d}" in result.message,
            "exit_code": result.exit_code, "ranks_left": r["totals"]["ranks_left"],
            "all_stopped_after_detection_s": round(max(st.ended or 0.0 for st in result.ranks) - seen, 2) if seen else None,
            "launcher_done_after_detection_s": round(r["end"] - seen, 2) if seen else None,
        })


def cmd_ssh(args: argparse.Namespace) -> None:
    from benchmarks.loopback_sshd import loopback_sshd
    from zerorun.launch.remote import preflight
    from zerorun.launch.ssh import SshOptions, close_client, connect_nodes

    n = args.connections
    with loopback_sshd(n) as (config, home):
        os.environ["HOME"] = home
        opts = SshOptions(ssh_config=config, parallelism=args.parallelism, preflight_timeout_s=300.0)
        aliases = [f"node{i}" for i in range(n)]
        import paramiko  # noqa: F401 - its import cost is not a per-connection cost

        # 1. The connections alone (TCP, key exchange, host key check, public-key auth).
        rss0, threads0 = _rss(), threading.active_count()
        cpu0, t0 = time.process_time(), time.monotonic()
        conns = connect_nodes(aliases, opts)
        connect = {"wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0,
                   "threads": threading.active_count() - threads0, "rss": _rss() - rss0}
        for _, client in conns.values():
            close_client(client)
        time.sleep(1.0)
        # 2. The whole preflight: connections + the agent's channel on each (its reader threads)
        # + the hello exchange. Its wall time includes starting n Python agents on THIS machine.
        rss0, threads0 = _rss(), threading.active_count()
        cpu0, t0 = time.process_time(), time.monotonic()
        pf = preflight(aliases, opts, master=None, master_port=29500, local_port_check=lambda _p: None)
        full = {"wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0,
                "threads": threading.active_count() - threads0, "rss": _rss() - rss0}
        pf.close()
    rounds = -(-n // args.parallelism)
    _save("ssh", f"{n}-p{args.parallelism}", {
        "connections": n, "parallelism": args.parallelism,
        "connect_wall_s": round(connect["wall_s"], 3), "connect_cpu_s": round(connect["cpu_s"], 3),
        "connect_cpu_ms_per_connection": round(1000 * connect["cpu_s"] / n, 2),
        "connect_wall_ms_per_round": round(1000 * connect["wall_s"] / rounds, 1),
        "connect_threads_per_connection": round(connect["threads"] / n, 2),
        "connect_rss_kib_per_connection": round(connect["rss"] / 1024 / n, 1),
        "preflight_wall_s": round(full["wall_s"], 3),
        "preflight_cpu_ms_per_node": round(1000 * full["cpu_s"] / n, 2),
        "preflight_threads_per_node": round(full["threads"] / n, 2),
        "preflight_rss_kib_per_node": round(full["rss"] / 1024 / n, 1),
        "note": "sshd, the agents and the launcher share this machine: wall times include their CPU; "
                "the launcher's own CPU, threads and RSS are per connection",
        "extrapolated_1000_nodes_p64": {
            "launcher_cpu_s": round(1000 * full["cpu_s"] / n, 1),
            "connect_rounds_s": round(-(-1000 // 64) * connect["wall_s"] / rounds, 1),
            "threads": round(1000 * full["threads"] / n),
            "rss_mib": round(1000 * full["rss"] / n / 2**20, 1),
        },
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    })


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launcher_scale")
    sub = parser.add_subparsers(dest="cmd", required=True)

    def nodes_arg(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[int(x) for x in default.split(",")])
        p.add_argument("--ranks", type=int, default=8)

    p = sub.add_parser("startup")
    nodes_arg(p, "8,64,256,1000")
    p.add_argument("--latency", type=float, default=0.05)
    p.add_argument("--parallelism", type=int, default=32)
    p.add_argument("--hold", type=float, default=3.0)
    p = sub.add_parser("throughput")
    nodes_arg(p, "1000")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--event-interval", type=float, default=5.0)
    p.add_argument("--heartbeat-timeout", type=float, default=60.0)
    p.add_argument("--host-nice", type=int, default=10, help="niceness of the simulated agent hosts")
    p = sub.add_parser("failfast")
    nodes_arg(p, "8,64,256,1000")
    p = sub.add_parser("silent")
    nodes_arg(p, "1000")
    p.add_argument("--timeout", type=float, default=10.0)
    p = sub.add_parser("ssh")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--parallelism", type=int, default=32)
    args = parser.parse_args(argv)
    {"startup": cmd_startup, "throughput": cmd_throughput, "failfast": cmd_failfast,
     "silent": cmd_silent, "ssh": cmd_ssh}[args.cmd](args)


if __name__ == "__main__":
    main()

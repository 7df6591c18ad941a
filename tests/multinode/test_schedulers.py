"""`--launcher slurm` on a real Slurm cluster (slurmctld + a slurmd per fake host, see
slurm_fabric.py) and `--launcher mpi` with a real Open MPI: the agents start with one srun /
mpirun and dial back to the launcher. Checks: a 4-rank ZeRO-3 job from `salloc -N2`, from an
sbatch script and through mpirun, each with the losses of the same job over SSH; scancel,
SIGTERM to zerorun, a killed mpirun and a failing rank on node 2 stop everything within 10 s
with nothing left on any node."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import mn_fabric
import pytest
import slurm_fabric
from mn_helpers import SCRIPT, Launch, describe, launcher_env, run_launcher, wait_clean

pytestmark = pytest.mark.multinode

ZERO_CONFIG = (
    "train_micro_batch_size_per_gpu: 16\ngradient_accumulation_steps: 1\n"
    "optimizer: {type: AdamW, params: {lr: 0.02}}\nzero_optimization: {stage: 3}\n"
)


@pytest.fixture(scope="module")
def slurm(cluster) -> Iterator[slurm_fabric.Slurm]:  # type: ignore[no-untyped-def]
    nodes = cluster.nodes[:2]
    s = slurm_fabric.start(cluster, nodes)
    try:
        for n in nodes:  # slurmd and its init belong to the idle node, not to a job
            n.baseline |= n.pids()
        yield s
    finally:
        slurm_fabric.stop(s)
        for n in nodes:
            n.baseline = {p for p in n.baseline if p in n.pids()}


def config(nodes, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    """Stage 3, and each node's gloo interface (the namespaces' interface names differ)."""
    path = tmp_path / "zero3.yaml"
    path.write_text(
        ZERO_CONFIG
        + "launcher:\n  host_env:\n"
        + "".join(f"    {n.alias}: {{GLOO_SOCKET_IFNAME: {n.ifname}}}\n" for n in nodes)
    )
    return path


def zsteps(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"\[node\d:(\d)\] +ZSTEP 29 loss (\S+)", out)}


def mpi_reports(prefix: Path, out: str) -> dict[int, str]:
    """Each MPI rank's INFO and ZSTEP lines from its own MN_REPORT file (named by the rank Open
    MPI gave it): mpirun --tag-output merges the ranks' output and was seen joining two ranks'
    lines mid-line, so the tests read no line of mpirun's own output."""
    reports = {int(f.suffix[1:]): f.read_text() for f in prefix.parent.glob(prefix.name + ".*")}
    assert sorted(reports) == [0, 1, 2, 3], out
    return reports


def mpirun_forward(env: dict[str, str]) -> list[str]:
    """A user's mpirun job: this checkout on PYTHONPATH (changes ``env``), and mpirun's -x flags
    that forward the job's variables to every rank."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")]))
    return [a for name in ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL", "PYTHONPATH", "MN_MODE", "MN_CONFIG", "MN_REPORT")
            for a in ("-x", name)]


def run_user_mpirun(argv: list[str], env: dict[str, str], cwd: Path, prefix: Path) -> tuple[dict[int, str], dict[int, str], str]:
    """Runs a user's mpirun command line, which must succeed: each rank's report (mpi_reports),
    each rank's final loss, and mpirun's output."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    reports = mpi_reports(prefix, out)
    losses = {rank: m[1] for rank, text in reports.items() for m in re.finditer(r"^ZSTEP 29 loss (\S+)$", text, re.M)}
    return reports, losses, out


def zero_args(nodes, tmp_path: Path) -> list[str]:  # type: ignore[no-untyped-def]
    return ["--device", "cpu", "--pg_timeout", "60", "--config", str(config(nodes, tmp_path)), "--env", "MN_MODE=zero", str(SCRIPT)]


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> dict[int, str]:  # type: ignore[no-untyped-def]
    """The final losses of the 4-rank ZeRO-3 job over SSH."""
    tmp_path = tmp_path_factory.mktemp("ssh")
    code, out = run_launcher(
        ["--hostfile", str(cluster.dir / "hostfile"), "--exclude", "node3", *zero_args(cluster.nodes[:2], tmp_path)],
        env=launcher_env(cluster),
        cwd=tmp_path,
    )
    assert code == 0, out
    losses = zsteps(out)
    assert sorted(losses) == [0, 1, 2, 3], out
    return losses


def test_salloc_and_sbatch_train_like_ssh(cluster, slurm, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = zero_args(slurm.nodes, tmp_path)

    # From inside `salloc -N2`: auto picks slurm.
    env = slurm.env(launcher_env(cluster))
    proc = subprocess.run(
        ["salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "zerorun", *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "zerorun: launcher slurm: auto: inside Slurm allocation" in out
    assert zsteps(out) == reference, out
    for rank in range(4):
        assert f"[node{rank // 2 + 1}:{rank}] INFO rank={rank} world=4" in re.sub(r"\] +", "] ", out), out
    assert "unnamed_secret=absent" in out  # a secret-looking variable nobody named stays home, as over SSH

    # From a batch script written and submitted by `zerorun sbatch`, with --num_gpus instead of
    # the allocation's task count.
    log = tmp_path / "job.out"
    proc = subprocess.run(
        [sys.executable, "-m", "zerorun", "sbatch", "-N", "2", "--output", str(log), "--sbatch_args", "--wait",
         "--num_gpus", "2", *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    out = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + out
    assert "zerorun: submitted batch job" in proc.stdout
    assert zsteps(out) == reference, out
    assert not wait_clean(slurm.nodes, 10)


def _running_job(cluster, slurm, tmp_path: Path, alloc_env: dict[str, str], **mn: str) -> Launch:  # type: ignore[no-untyped-def]
    """zerorun started from this shell inside an existing allocation (SLURM_JOB_ID set, as in a
    batch script), so the test signals zerorun itself."""
    env = slurm.env(launcher_env(cluster, **alloc_env))
    named = [a for k, v in mn.items() for a in ("--env", f"{k}={v}")]
    args = ["--device", "cpu", "--num_gpus", "1", "--grace_period", "2", "--pg_timeout", "60",
            "--config", str(config(slurm.nodes, tmp_path)), *named, str(SCRIPT)]
    return Launch(args, env=env, cwd=tmp_path)


def test_stop_paths(cluster, slurm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """From a login node zerorun obtains the allocation itself; scancel, SIGTERM to zerorun, a
    failing rank on node 2: stopped within 10 s everywhere."""
    env = slurm.env(launcher_env(cluster))
    # From the "login node" (no allocation): --launcher slurm --num_nodes 2 obtains one with salloc.
    code, out = run_launcher(["--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "1", "--device", "cpu",
                              str(SCRIPT.with_name("hello.py")), "x y"], env=env, cwd=tmp_path, timeout=60)
    assert code == 0, out
    assert "outside an allocation, obtaining one: salloc --nodes=2" in out, out
    assert "zerorun: launcher slurm: --launcher slurm" in out, out
    for rank, node in ((0, "node1"), (1, "node2")):
        assert f"HELLO rank={rank} node_rank={rank} host={node} argv=['x y']" in out, out

    # An allocation that stays while the tests start jobs in it from this shell.
    alloc = subprocess.Popen(["salloc", "-N2", "--ntasks-per-node=2", "--no-shell"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out = alloc.communicate(timeout=30)[0]
        job_id = re.search(r"Granted job allocation (\d+)", out)
        assert job_id, out
        jid = job_id[1]
        alloc_env = {"SLURM_JOB_ID": jid, "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
                     "SLURM_TASKS_PER_NODE": "2(x2)"}

        # One zerorun per node inside a step (`srun --ntasks-per-node=1 zerorun ...` in a batch
        # script): per-node mode from SLURM_NODEID, node 0 shows both nodes' ranks.
        proc = subprocess.run(
            ["srun", f"--jobid={jid}", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "zerorun", "--device", "cpu",
             "--num_gpus", "1", str(SCRIPT.with_name("hello.py"))],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
        )
        out = re.sub(r"\] +", "] ", proc.stdout + proc.stderr)
        assert proc.returncode == 0, out
        assert out.count(f"launcher pernode: auto: inside Slurm step {jid}.") == 2, out
        assert "[node1:0] HELLO rank=0 node_rank=0 host=node1" in out, out  # on node 0's console...
        assert out.count("HELLO rank=1 node_rank=1 host=node2") == 2, out  # ...and on node 1's own

        def job(mode: str, **extra: str) -> Launch:
            return _running_job(cluster, slurm, tmp_path, alloc_env, MN_MODE=mode, **extra)

        # 1. SIGTERM to zerorun: forwarded, exit 143.
        launch = job("loop")
        launch.wait_for(lambda o: "[node2:1] STEP 10" in o, 90)
        t0 = time.monotonic()
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.finish(15) == 143, launch.output
        assert time.monotonic() - t0 < 10
        left = wait_clean(slurm.nodes, 10)
        assert not left, describe(left)

        # 2. A failing rank on node 2: its exit code, every node stopped.
        launch = job("fail", MN_FAIL_RANK="1", MN_FAIL_CODE="3")
        assert launch.finish(90) == 3, launch.output
        assert re.search(r"rank node2:1 failed \(exit 3\)", launch.output), launch.output
        left = wait_clean(slurm.nodes, 10)
        assert not left, describe(left)

        # 3. scancel of the job: the step dies, the launcher reports the nodes lost, exit 255.
        launch = job("loop")
        launch.wait_for(lambda o: "[node2:1] STEP 10" in o, 90)
        t0 = time.monotonic()
        subprocess.run(["scancel", jid], env=env, check=True, timeout=10)
        code = launch.finish(15)
        assert time.monotonic() - t0 < 10, launch.output
        assert code == 255, launch.output
        left = wait_clean(slurm.nodes, 10)
        assert not left, describe(left)
    finally:
        subprocess.run(["scancel", "-u", "root"], env=env, timeout=10, check=False)
        if alloc.poll() is None:
            alloc.kill()


def _children(pid: int, comm: str) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            name = fields[0].split("(", 1)[1]
            if int(fields[1].split()[1]) == pid and name == comm:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_mpi_trains_like_ssh_and_stops(cluster, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    nodes = cluster.nodes[:2]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n.alias} slots=2\n" for n in nodes))
    home = cluster.home / ".ssh"
    # mpirun's own ssh: the test's config and known hosts (OpenSSH reads ~ from passwd, not $HOME).
    rsh = f"ssh -F {home / 'config'} -o BatchMode=yes -o UserKnownHostsFile={home / 'known_hosts'}"
    env = launcher_env(cluster, OMPI_MCA_plm_rsh_agent=rsh)
    head = ["--launcher", "mpi", "--hostfile", str(hostfile)]
    code, out = run_launcher([*head, *zero_args(nodes, tmp_path)], env=env, cwd=tmp_path, timeout=120)
    assert code == 0, out
    assert out.startswith("zerorun: launcher mpi: --launcher mpi"), out
    assert zsteps(out) == reference, out
    assert not wait_clean(nodes, 10)

    stop = [*head, "--num_gpus", "1", "--device", "cpu", "--grace_period", "2", "--pg_timeout", "60",
            "--config", str(config(nodes, tmp_path))]
    # A killed mpirun: its daemons take the agents along, the launcher reports the nodes lost.
    launch = Launch([*stop, "--env", "MN_MODE=loop", str(SCRIPT)], env=env, cwd=tmp_path)
    launch.wait_for(lambda o: "[node2:1] STEP 10" in o, 90)
    mpirun = _children(launch.proc.pid, "mpirun")
    assert len(mpirun) == 1, mpirun
    t0 = time.monotonic()
    os.kill(mpirun[0], signal.SIGKILL)
    assert launch.finish(15) == 255, launch.output
    assert time.monotonic() - t0 < 10
    left = wait_clean(nodes, 10)
    assert not left, describe(left)

    # A failing rank on node 2: its exit code, as over SSH.
    code, out = run_launcher([*stop, "--env", "MN_MODE=fail", "--env", "MN_FAIL_RANK=1", str(SCRIPT)], env=env, cwd=tmp_path)
    assert code == 3, out
    assert re.search(r"rank node2:1 failed \(exit 3\)", out), out
    left = wait_clean(nodes, 10)
    assert not left, describe(left)


def test_restarts_under_slurm(cluster, slurm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """--max_restarts with --launcher slurm (launch/restart.py): every attempt is a new srun step in
    the allocation; rank 1 (node 2) kills itself in each, so the budget runs out with its code."""
    env = slurm.env(launcher_env(cluster))
    job = Path(__file__).parents[1] / "launch" / "scripts" / "restart_job.py"
    code, out = run_launcher(
        ["--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "1", "--device", "cpu", "--grace_period", "1",
         "--max_restarts", "1", "--log_dir", str(tmp_path / "logs"), "--env", "RJ_MODE=kill", str(job)],
        env=env, cwd=tmp_path, timeout=90,
    )
    assert code == 137, out
    assert "attempt 2/2 (restart)" in out and "restart budget of 1 exhausted" in out, out
    assert out.count("zerorun: launcher slurm") >= 2, out  # one srun step per attempt
    assert re.search(r"attempt 2: rank node2:1 was killed \(signal 9", out), out
    left = wait_clean(slurm.nodes, 10)
    assert not left, describe(left)


def test_user_started_mpirun_finds_rank0s_host(cluster, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`mpirun -np 2 -H node1:2 ... : -np 2 -H node2:2 ...` started by the user (one process per
    rank, no zerorun launcher, no MASTER_ADDR): ranks from OMPI_COMM_WORLD_*, the master from the
    PMIx server (rank 0's host name, which every fake host has its own of and resolves), a port
    from the job's namespace. Ranks 0-1 (node1) without the shim, with zerorun's own process
    group (what zerorun.initialize creates); ranks 2-3 (node2) through the shim, a torchrun-style
    script (init_process_group from the variables the shim exports): both paths must find the
    same master and port, or the process group never forms."""
    home = cluster.home / ".ssh"
    rsh = f"ssh -F {home / 'config'} -o BatchMode=yes -o UserKnownHostsFile={home / 'known_hosts'}"
    conf = tmp_path / "zero3.yaml"
    conf.write_text(ZERO_CONFIG)
    prefix = tmp_path / "report"
    env = launcher_env(cluster, OMPI_MCA_plm_rsh_agent=rsh, MN_MODE="zero", MN_CONFIG=str(conf), MN_REPORT=str(prefix))
    forward = mpirun_forward(env)
    # Open MPI takes -x per application context (the part of the command line between colons).
    argv = ["mpirun", "--allow-run-as-root", "--bind-to", "none", "--tag-output",
            "-np", "2", "-H", "node1:2", *forward, "env", "MN_INIT=zerorun", sys.executable, str(SCRIPT), ":",
            "-np", "2", "-H", "node2:2", *forward, sys.executable, "-m", "zerorun.shim", str(SCRIPT)]
    reports, losses, out = run_user_mpirun(argv, env, tmp_path, prefix)
    for rank, text in reports.items():
        host = f"node{rank // 2 + 1}"
        assert re.search(rf"^INFO rank={rank} world=4 .*host={host} master=node1$", text, re.M), (rank, text, out)
    # The shim exported torchrun's local variables; zerorun's own process group needs none.
    assert re.search(r"^INFO rank=3 world=4 local_rank=1 local_world=2 ", reports[3], re.M), (reports[3], out)
    assert losses == reference, (reports, out)
    assert not wait_clean(cluster.nodes[:2], 10)


def test_user_mpirun_inside_an_allocation(cluster, slurm, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`salloc -N2 mpirun -np 4 ...`: mpirun starts its daemons with srun, so every rank carries
    its daemon's SLURM_PROCID/SLURM_NTASKS (node index, node count); the ranks must go by Open
    MPI's variables and find rank 0's host through PMIx, not Slurm's first node and job-id port."""
    conf = tmp_path / "zero3.yaml"
    conf.write_text(ZERO_CONFIG)
    prefix = tmp_path / "report"
    env = slurm.env(launcher_env(cluster, MN_MODE="zero", MN_CONFIG=str(conf), MN_REPORT=str(prefix)))
    forward = mpirun_forward(env)
    argv = ["salloc", "-N2", "--ntasks-per-node=2", "mpirun", "--allow-run-as-root", "-np", "4", "--bind-to", "none",
            "--tag-output", *forward, sys.executable, "-m", "zerorun.shim", str(SCRIPT)]
    reports, losses, out = run_user_mpirun(argv, env, tmp_path, prefix)
    for rank, text in reports.items():
        host = f"node{rank // 2 + 1}"
        assert re.search(rf"^INFO rank={rank} world=4 local_rank={rank % 2} .*host={host} master=node1$", text, re.M), (
            rank, text, out)  # fmt: skip
    assert losses == reference, (reports, out)
    assert not wait_clean(slurm.nodes, 10)


def test_mpi_launcher_inside_an_allocation(cluster, slurm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`--launcher mpi` from inside `salloc`: mpirun starts its daemons through srun, so the agents
    also carry SLURMD_NODENAME; each must still name itself by its MPI rank (the agents were
    turned away: "0 of 2 dialed in")."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    env = slurm.env(launcher_env(cluster))
    proc = subprocess.run(
        ["salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "zerorun", "--launcher", "mpi", "--hostfile",
         str(hostfile), "--device", "cpu", str(SCRIPT.with_name("hello.py")), "x"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=90,
    )  # fmt: skip
    out = re.sub(r"\] +", "] ", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out
    for rank in range(4):
        node = f"node{rank // 2 + 1}"
        assert f"[{node}:{rank}] HELLO rank={rank} node_rank={rank // 2} host={node} argv=['x']" in out, out
    assert not wait_clean(slurm.nodes, 10)


def test_kubernetes_manifests_train_like_ssh(cluster, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Each manifest of templates/kubernetes/, without a cluster: its pods (names, environment,
    command as the controllers set them: tests/launch/k8s_pods.py) on two fake hosts, each pod's
    exact container command run over ssh in its working directory with that environment, the
    pods' DNS names resolving to their hosts. The 4-rank ZeRO-3 job trains with the losses of
    the same job over SSH."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "launch"))
    import k8s_pods

    nodes = cluster.nodes[:2]
    home = cluster.home / ".ssh"
    ssh = ["ssh", "-F", str(home / "config"), "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={home / 'known_hosts'}"]
    bin_dir = str(Path(sys.executable).parent)
    for manifest in sorted(k8s_pods.TEMPLATES.glob("*.yaml")):
        pods = k8s_pods.pods(manifest)
        assert len(pods) == len(nodes), manifest.name
        mn_fabric.add_names(cluster, {n.addr: [p.hostname, *p.dns_names] for n, p in zip(nodes, pods, strict=True)})
        workdir = tmp_path / manifest.stem  # the image's workingDir
        workdir.mkdir()
        (workdir / "train.py").write_text(SCRIPT.read_text())
        (workdir / "ds_config.json").write_text(
            '{"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, '
            '"optimizer": {"type": "AdamW", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 3}}'
        )
        procs = []
        for node, pod in zip(nodes, pods, strict=True):
            # The pod's environment, plus what the image would provide (PATH) and the test's script mode.
            env = {**pod.env, "PATH": f"{bin_dir}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "MN_MODE": "zero",
                   "TORCH_CPP_LOG_LEVEL": "ERROR", "HOME": "/root"}
            remote = f"cd {shlex.quote(str(workdir))} && exec env {shlex.join(f'{k}={v}' for k, v in env.items())} " \
                     + shlex.join(pod.command)
            procs.append(subprocess.Popen([*ssh, node.alias, remote], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, text=True))
        outs = []
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=150)[0])
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise AssertionError(f"{manifest.name}: a pod did not finish") from None
        out = re.sub(r"\] +", "] ", outs[0])
        assert [p.returncode for p in procs] == [0, 0], f"{manifest.name}:\n" + "\n---\n".join(outs)
        assert "zerorun: launcher pernode: auto:" in out, out
        losses = {int(m[1]): m[2] for m in re.finditer(r"\[[\w.-]+:(\d)\] ZSTEP 29 loss (\S+)", out)}
        assert losses == reference, f"{manifest.name}:\n{out}"
        left = wait_clean(nodes, 10)
        assert not left, describe(left)

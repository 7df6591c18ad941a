"""The Kubernetes manifests of templates/kubernetes/ map onto what zerorun reads: for every pod the
cluster would make (tests/launch/k8s_pods.py: names, environment, command as the controllers set
them), the pod's own command line, parsed by zerorun's CLI, picks per-node mode with the pod's
index as node rank, the pod count as node count, and a master that is node 0's DNS name.
tests/multinode/test_schedulers.py::test_kubernetes_manifests_train_like_ssh runs the same commands on
fake hosts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import k8s_pods  # noqa: E402

from zerorun.cli import launch_cmd  # noqa: E402
from zerorun.launch import pernode  # noqa: E402
from zerorun.launch.plan import LaunchOptions  # noqa: E402
from zerorun.launch.selection import choose_launcher  # noqa: E402

MANIFESTS = sorted(k8s_pods.TEMPLATES.glob("*.yaml"))


def parse(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> LaunchOptions:
    """The LaunchOptions zerorun's CLI builds from a command line (nothing runs)."""
    seen: list[LaunchOptions] = []

    def capture(options: LaunchOptions) -> int:
        seen.append(options)
        return 0

    monkeypatch.setattr(launch_cmd, "_run", capture)
    with pytest.raises(SystemExit) as info:
        launch_cmd.app(argv)
    assert info.value.code == 0 and len(seen) == 1, argv
    return seen[0]


def test_every_manifest_is_covered() -> None:
    assert {m.name for m in MANIFESTS} == {"pytorchjob.yaml", "indexed-job.yaml", "jobset.yaml"}


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.stem)
def test_pods_map_onto_per_node_mode(manifest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pods = k8s_pods.pods(manifest)
    assert len(pods) >= 2
    specs = []
    for pod in pods:
        assert pod.command[0] == "zerorun", pod.command
        options = parse(pod.command[1:], monkeypatch)
        assert options.target.script == "train.py" and options.target.args == ("--deepspeed", "ds_config.json")
        choice = choose_launcher(
            options.launcher, hostfile=options.hostfile, nnodes=options.nnodes, node_rank=options.node_rank,
            environ=pod.env,
        )  # fmt: skip
        assert choice.launcher == "pernode", (pod.hostname, choice.line())
        spec = pernode.resolve(
            nnodes=options.nnodes, node_rank=options.node_rank, master_addr=options.master_addr,
            master_port=options.master_port, rdzv_port=options.rdzv_port, nproc=options.num_gpus,
            rdzv_timeout=options.rdzv_timeout, environ=pod.env, slurm=choice.slurm,
        )  # fmt: skip
        assert spec.node_rank == pod.index, (pod.hostname, spec)
        assert spec.nnodes == len(pods), (pod.hostname, spec)
        assert spec.nproc is None  # "auto" / none given: one rank per GPU of the pod
        # The master is node 0 by a name the cluster's DNS gives it, never WORLD_SIZE's count.
        assert spec.master_addr in pods[0].dns_names, (spec.master_addr, pods[0].dns_names)
        assert spec.rdzv_port == spec.master_port + 1
        specs.append(spec)
    assert len({(s.master_addr, s.master_port) for s in specs}) == 1


def test_pytorchjob_world_size_is_not_the_node_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's WORLD_SIZE counts processes (pods x nprocPerNode): with nprocPerNode 8 it
    says 16 for 2 pods; zerorun still runs 2 nodes of 8 ranks."""
    manifest = k8s_pods.TEMPLATES / "pytorchjob.yaml"
    doc = k8s_pods.documents(manifest)[0]
    doc["spec"]["nprocPerNode"] = "8"
    pods = k8s_pods._pytorchjob(doc)
    assert pods[1].env["WORLD_SIZE"] == "16"
    options = parse(pods[1].command[1:], monkeypatch)
    spec = pernode.resolve(
        nnodes=options.nnodes, node_rank=None, master_addr=None, master_port=None, rdzv_port=None, nproc=None,
        rdzv_timeout=None, environ=pods[1].env,
    )  # fmt: skip
    assert (spec.nnodes, spec.node_rank, spec.nproc) == (2, 1, 8)

"""What a Kubernetes cluster gives each pod of a manifest in templates/kubernetes/: its host name,
the names other pods reach it by, its environment and its command, as the controllers set them:

- PyTorchJob (Kubeflow training operator, pkg/controller.v1/pytorch/envvar.go and master.go):
  pods `NAME-master-0`, `NAME-worker-i`, each behind a headless Service of its own name;
  PYTHONUNBUFFERED, MASTER_ADDR/PET_MASTER_ADDR = `NAME-master-0`, MASTER_PORT/PET_MASTER_PORT =
  the port named `pytorchjob-port` (default 23456), WORLD_SIZE = replicas x nprocPerNode (1 when
  not a number), RANK = PET_NODE_RANK = 0 for the master and 1 + i for worker i,
  PET_NPROC_PER_NODE = spec.nprocPerNode, PET_NNODES = replicas in all (without an elasticPolicy).
- batch/v1 Job with `completionMode: Indexed`: pod i is `NAME-i` with JOB_COMPLETION_INDEX=i (and
  the batch.kubernetes.io/job-completion-index annotation); with `subdomain: S` and a headless
  Service S selecting the pods it is reachable as `NAME-i.S`.
- JobSet (jobset.x-k8s.io): replicated job R, job j, pod p is `JS-R-j-p`, an indexed Job's pod
  (JOB_COMPLETION_INDEX=p), reachable as `JS-R-j-p.SUBDOMAIN` (spec.network.subdomain, default
  the JobSet's name; the controller makes the headless Service).

Pure (yaml in, pods out): tests/launch/test_k8s_templates.py checks what zerorun reads from
these, tests/multinode/test_schedulers.py::test_kubernetes_manifests_train_like_ssh runs the
pods' commands on fake hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "kubernetes"
_INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@dataclass(frozen=True)
class Pod:
    index: int  # in the controller's numbering: the node rank the pod must get
    hostname: str
    dns_names: tuple[str, ...]  # names other pods reach this one by
    env: dict[str, str]
    command: list[str]
    working_dir: str | None


def documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        for key in ("apiVersion", "kind", "metadata", "spec"):
            assert key in doc, f"{path.name}: a {doc.get('kind')} without {key}"
    return docs


def _container_env(container: dict[str, Any], index: int) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == _INDEX_ANNOTATION:
            env[item["name"]] = str(index)
        else:
            raise AssertionError(f"env {item['name']}: only values and the completion index are emulated")
    return env


def _pod(index: int, hostname: str, names: tuple[str, ...], container: dict[str, Any], env: dict[str, str]) -> Pod:
    command = [str(a) for a in [*container.get("command", []), *container.get("args", [])]]
    return Pod(index, hostname, names, env, command, container.get("workingDir"))


def _pytorchjob(doc: dict[str, Any]) -> list[Pod]:
    name, spec = doc["metadata"]["name"], doc["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())
    nproc = str(spec.get("nprocPerNode", "auto"))
    master = f"{name}-master-0"
    port = 23456
    for c in replicas["Master"]["template"]["spec"]["containers"]:
        if c["name"] == "pytorch":
            port = next((p["containerPort"] for p in c.get("ports", []) if p.get("name") == "pytorchjob-port"), port)
    pods = []
    for rtype in ("Master", "Worker"):
        for i in range(int(replicas.get(rtype, {}).get("replicas", 0))):
            rank = i if rtype == "Master" else i + 1
            container = next(c for c in replicas[rtype]["template"]["spec"]["containers"] if c["name"] == "pytorch")
            env = _container_env(container, rank)
            env.update(
                PYTHONUNBUFFERED="0",
                MASTER_PORT=str(port), PET_MASTER_PORT=str(port), MASTER_ADDR=master, PET_MASTER_ADDR=master,
                WORLD_SIZE=str(total * (int(nproc) if nproc.isdigit() else 1)), RANK=str(rank),
                PET_NPROC_PER_NODE=nproc, PET_NODE_RANK=str(rank),
            )  # fmt: skip
            if "elasticPolicy" not in spec:
                env["PET_NNODES"] = str(total)
            host = f"{name}-{rtype.lower()}-{i}"
            pods.append(_pod(rank, host, (host,), container, env))
    return sorted(pods, key=lambda p: p.index)


def _headless_service(docs: list[dict[str, Any]], name: str, labels: dict[str, str]) -> bool:
    for doc in docs:
        if doc["kind"] == "Service" and doc["metadata"]["name"] == name:
            spec = doc["spec"]
            selector = spec.get("selector", {})
            return spec.get("clusterIP") == "None" and all(labels.get(k) == v for k, v in selector.items())
    return False


def _indexed_job(doc: dict[str, Any], docs: list[dict[str, Any]]) -> list[Pod]:
    name, spec = doc["metadata"]["name"], doc["spec"]
    assert spec.get("completionMode") == "Indexed", f"Job {name}: not an indexed Job (no node ranks)"
    pod_spec = spec["template"]["spec"]
    labels = {**spec["template"].get("metadata", {}).get("labels", {}), "job-name": name,
              "batch.kubernetes.io/job-name": name}  # fmt: skip
    subdomain = pod_spec.get("subdomain")
    reachable = subdomain is not None and _headless_service(docs, subdomain, labels)
    pods = []
    for i in range(int(spec["completions"])):
        host = f"{name}-{i}"
        container = pod_spec["containers"][0]
        env = {**_container_env(container, i), "JOB_COMPLETION_INDEX": str(i)}
        pods.append(_pod(i, host, (f"{host}.{subdomain}",) if reachable else (), container, env))
    return pods


def _jobset(doc: dict[str, Any]) -> list[Pod]:
    name, spec = doc["metadata"]["name"], doc["spec"]
    network = spec.get("network", {})
    subdomain = network.get("subdomain", name)
    dns = network.get("enableDNSHostnames", True)
    pods = []
    for rjob in spec["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        for j in range(int(rjob.get("replicas", 1))):
            for p in range(int(job_spec.get("completions", 1))):
                host = f"{name}-{rjob['name']}-{j}-{p}"
                container = job_spec["template"]["spec"]["containers"][0]
                env = {**_container_env(container, p), "JOB_COMPLETION_INDEX": str(p)}
                pods.append(_pod(len(pods), host, (f"{host}.{subdomain}",) if dns else (), container, env))
    return pods


def pods(path: Path) -> list[Pod]:
    """Every pod the manifest's training workload makes, in node-rank order."""
    docs = documents(path)
    workloads = [d for d in docs if d["kind"] in ("PyTorchJob", "Job", "JobSet")]
    assert len(workloads) == 1, f"{path.name}: one training workload per manifest"
    doc = workloads[0]
    if doc["kind"] == "PyTorchJob":
        return _pytorchjob(doc)
    if doc["kind"] == "Job":
        return _indexed_job(doc, docs)
    return _jobset(doc)

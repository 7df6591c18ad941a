"""`--dry-run`: the rank table and the environment the ranks would get; nothing is started."""

from __future__ import annotations

import os
import shlex

from zerorun.launch.environment import redact_env, scrub
from zerorun.launch.plan import LaunchPlan

__all__ = ["format_dry_run"]


def format_dry_run(plan: LaunchPlan) -> str:
    device = (
        "device per node, probed at start (--device or --num_gpus fixes it)"
        if plan.device_per_node
        else f"device {plan.device}, backend {plan.backend}"
    )
    lines = [
        f"zerorun dry run {plan.run_id}: {plan.world_size} rank(s), {len(plan.nodes)} node(s), "
        f"{device}, master {plan.master_addr}:{plan.master_port}",
        # Script arguments may carry a secret that is also in the environment (--hf_token $HF_TOKEN).
        f"command: {scrub(shlex.join(plan.rank_argv(plan.ranks[0], 'python')), os.environ)}",
    ]
    head = ["rank", "local", "node", "host", "device", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]
    rows = []
    for spec in plan.ranks:
        node = plan.nodes[spec.node_rank]
        env = plan.rank_env(spec)
        base = {**os.environ, **node.env} if node.is_local else dict(node.env)
        omp = plan.defaults_env(spec.node_rank, base).get("OMP_NUM_THREADS", base.get("OMP_NUM_THREADS", "-"))
        dev = f"cuda:{spec.gpu}" if spec.gpu is not None else "cpu"
        rows.append([str(spec.rank), str(spec.local_rank), str(spec.node_rank), spec.host, dev,
                     env.get("CUDA_VISIBLE_DEVICES", "-"), omp])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    for row in [head, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    first = plan.ranks[0]
    env = {k: v for k, v in plan.rank_env(first).items() if k != "ZERORUN_CONFIG_JSON"}
    if plan.config_json is not None:
        env["ZERORUN_CONFIG_JSON"] = f"<{len(plan.config_json)} bytes of JSON>"
    lines.append(f"environment of rank {first.rank} (others differ in RANK, LOCAL_RANK, NODE_RANK, GROUP_RANK, ROLE_RANK):")
    lines += [f"  {k}={v}" for k, v in sorted(redact_env(env).items())]
    for node in plan.nodes:
        if node.env:
            lines.append(f"extra environment on {node.host.name}:")
            lines += [f"  {k}={v}" for k, v in sorted(redact_env(dict(node.env)).items())]
    return "".join(line + "\n" for line in lines)

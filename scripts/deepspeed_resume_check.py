"""Acceptance check: real DeepSpeed resumes from the DeepSpeed-layout files zerorun writes under
--deepspeed-compat -- weights AND optimizer states -- and continues exactly as zerorun does.

    .venv/bin/python scripts/deepspeed_resume_check.py --ds-env /tmp/ds-env \\
        --out benchmarks/results/deepspeed_resume_check.json

``--ds-env DIR``: the CPU-only DeepSpeed environment of scripts/deepspeed_layout_check.py (created
the same way when missing; minutes, which is why this is a script with a committed result and not
a CI test). Per case (scripts/deepspeed_resume_worker.py: an MLP with two optimizer param groups,
AdamW): 2 CPU ranks train 3 steps under zerorun's layer, save, and take step 4; then 2 real
DeepSpeed ranks (gloo) build the same engine, ``load_checkpoint`` the zerorun save and take the
same step 4 -- once with the optimizer states (``resume``), once without (``fresh``, the control:
Adam restarting from zero moments). Pass: ``resume`` gives zerorun's step-4 weights (max abs
difference 0 in fp32, within one bf16 rounding in bf16) while ``fresh`` does not.

The other way too: DeepSpeed saves its own checkpoint after 3 steps (``dssave``), and zerorun's
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (this process, no
DeepSpeed installed) reads it in DeepSpeed's layout: compared with DeepSpeed's own
``zero_to_fp32.py`` output of the same checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from deepspeed_layout_check import copy_zero_to_fp32, setup  # noqa: E402

CASES = ["s1-fp32", "s2-fp32", "s3-fp32", "s2-bf16", "s3-bf16"]
WORKER = "scripts/deepspeed_resume_worker.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "ACCELERATE_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def deepspeed_ranks(ds_python: Path, out: Path, case: str, mode: str, port: int) -> list[str]:
    """Two real DeepSpeed ranks on CPU (gloo); their errors, if any."""
    procs = [
        subprocess.Popen(
            [str(ds_python), WORKER, str(out), case, mode], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), DS_ACCELERATOR="cpu"),
        )
        for r in (0, 1)
    ]
    errors = []
    for r, proc in enumerate(procs):
        text, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            errors.append(f"rank {r}: exit {proc.returncode}: {text[-1500:]}")
    return errors


def read_deepspeeds_own(ds_python: Path, work: Path, case: str, port: int) -> dict:
    """DeepSpeed saves (dssave); its zero_to_fp32.py and zerorun's reader both rebuild the weights."""
    import torch

    from zerorun.compat.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    errors = deepspeed_ranks(ds_python, work, case, "dssave", port)
    if errors:
        return {"error": "deepspeed dssave: " + " | ".join(errors)}
    # a copy, as users run it (see deepspeed_layout_check.py)
    script = copy_zero_to_fp32(ds_python, work / "deepspeed_zero_to_fp32.py", env=_env())
    ckpt = work / f"{case}-ds"
    ds = subprocess.run([str(ds_python), str(script), str(ckpt), str(work / f"{case}-ds-fp32")],
                        env=_env(), capture_output=True, text=True)
    if ds.returncode != 0:
        return {"error": f"deepspeed zero_to_fp32: {ds.stderr[-1500:]}"}
    theirs = torch.load(work / f"{case}-ds-fp32" / "pytorch_model.bin")
    ours = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    same = sorted(theirs) == sorted(ours) and all(torch.equal(theirs[k], ours[k].view(theirs[k].shape)) for k in theirs)
    return {"deepspeed_checkpoint_files": sorted(p.name for p in next(ckpt.glob("global_step*")).iterdir()),
            "deepspeed_checkpoint_identical": same}


def max_diff(a: Path, b: Path) -> float:
    import torch

    x, y = torch.load(a), torch.load(b)
    assert sorted(x) == sorted(y)
    return max((x[k] - y[k]).abs().max().item() for k in x)


def main() -> int:
    args, ds_python, ds_version = setup(__doc__, "deepspeed_resume_check.json")
    results: dict = {"deepspeed_version": ds_version, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="zerorun-dsresume-") as tmp:
        work = Path(tmp)
        for i, case in enumerate(CASES):
            t0 = time.monotonic()
            entry: dict = {}
            saved = subprocess.run(
                [sys.executable, "-m", "zerorun", "--deepspeed-compat", "--num_gpus", "2", "--device", "cpu",
                 WORKER, str(work), case, "save"],
                cwd=ROOT, env=_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
            )
            if saved.returncode != 0:
                entry["error"] = f"zerorun save: {saved.stderr[-2000:]}"
            else:
                entry["files"] = sorted(p.name for p in (work / case / "global_step3").glob("*_states.pt"))
                for mode in ("resume", "fresh"):
                    errors = deepspeed_ranks(ds_python, work, case, mode, 29700 + 2 * i + (mode == "fresh"))
                    if errors:
                        entry["error"] = f"deepspeed {mode}: " + " | ".join(errors)
                        break
                    entry[f"{mode}_max_abs_diff_to_zerorun"] = max_diff(work / f"{case}-save.pt", work / f"{case}-{mode}.pt")
                if "error" not in entry:
                    entry.update(read_deepspeeds_own(ds_python, work, case, 29750 + i))
            tolerance = 0.0 if case.endswith("fp32") else 1e-2  # bf16: one rounding of the 16-bit weights
            entry["resumes_exactly"] = (
                "error" not in entry
                and entry["resume_max_abs_diff_to_zerorun"] <= tolerance < entry["fresh_max_abs_diff_to_zerorun"]
            )
            entry["reads_deepspeeds_checkpoint"] = entry.get("deepspeed_checkpoint_identical") is True
            entry["seconds"] = round(time.monotonic() - t0, 1)
            results["cases"][case] = entry
            print(case, {k: v for k, v in entry.items() if k != "files"}, flush=True)
    results["all_resume"] = all(c["resumes_exactly"] for c in results["cases"].values())
    results["all_read"] = all(c["reads_deepspeeds_checkpoint"] for c in results["cases"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["all_resume"] and results["all_read"] else 1


if __name__ == "__main__":
    sys.exit(main())

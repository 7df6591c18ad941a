"""Acceptance check: DeepSpeed's own zero_to_fp32.py rebuilds, from the DeepSpeed-layout files
zerorun writes under --deepspeed-compat, the same fp32 weights as zerorun's consolidation.

    .venv/bin/python scripts/deepspeed_layout_check.py --ds-env /tmp/ds-env \
        --out benchmarks/results/deepspeed_layout_check.json

``--ds-env DIR``: a separate virtual environment with a CPU-only DeepSpeed (created when missing:
``python -m venv``, this venv's site-packages added through a .pth file for torch, then
``DS_BUILD_OPS=0 pip install deepspeed==VERSION`` from the sdist; a few minutes, which is why this
is a script whose output is committed and not a CI test). For every case, 2 CPU ranks train a
small model (tied weights, a buffer, a frozen parameter) through the layer and save; then
DeepSpeed's script, run as users run it (``python zero_to_fp32.py CKPT OUT``, a copy of the one in
the installed package), writes pytorch_model.bin, and zerorun's consolidation
(``get_fp32_state_dict``: tied weights under every name, as DeepSpeed's output has them) is
compared with it tensor by tensor (names, dtypes, shapes, values). DeepSpeed's
``--safe_serialization`` is not used: it stops on tied weights ("Some tensors share memory"),
with DeepSpeed's own checkpoints too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's zerorun, as the ranks get it (PYTHONPATH)
CASES = ["s1-bf16", "s1-fp16", "s2-bf16", "s2-fp16", "s3-bf16", "s3-fp16", "s2-fp32"]
DS_VERSION = "0.19.8"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    return env


def make_ds_env(path: Path) -> Path:
    python = path / "bin" / "python"
    if python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    site = next((path / "lib").glob("python*/site-packages"))
    here = next(Path(sys.prefix, "lib").glob("python*/site-packages"))
    (site / "zerorun_torch.pth").write_text(str(here) + "\n")  # torch from this venv, not a second copy
    env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"deepspeed=={DS_VERSION}"], check=True, env=env)
    return python


def setup(doc: str, result: str) -> tuple[argparse.Namespace, Path, str]:
    """The check scripts' command line: (args, the DeepSpeed venv's python, its DeepSpeed version)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ds-env", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results" / result)
    args = parser.parse_args()
    ds_python = make_ds_env(args.ds_env)
    ds_version = subprocess.run(
        [str(ds_python), "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    return args, ds_python, ds_version


def copy_zero_to_fp32(ds_python: Path, script: Path, env: dict[str, str] | None = None) -> Path:
    """Copies the installed DeepSpeed's ``utils/zero_to_fp32.py`` to ``script``."""
    package = subprocess.run(
        [str(ds_python), "-c", "import importlib.util as u; print(u.find_spec('deepspeed').submodule_search_locations[0])"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip()
    script.write_bytes(Path(package, "utils", "zero_to_fp32.py").read_bytes())
    return script


def compare(ds_file: Path, ckpt: Path) -> dict:
    import torch

    from zerorun.runtime.checkpoint import get_fp32_state_dict

    x, y = torch.load(ds_file, map_location="cpu"), get_fp32_state_dict(ckpt)
    diffs = {}
    for name in sorted(set(x) & set(y)):
        same_kind = x[name].dtype == y[name].dtype and x[name].shape == y[name].shape
        diffs[name] = (x[name].float() - y[name].float()).abs().max().item() if same_kind else float("inf")
    return {
        "tensors": len(diffs),
        "only_deepspeed": sorted(set(x) - set(y)),
        "only_zerorun": sorted(set(y) - set(x)),
        "dtypes": sorted({str(t.dtype) for t in x.values()}),
        "max_abs_diff": max(diffs.values()) if diffs else None,
        "identical": not (set(x) ^ set(y)) and all(d == 0.0 for d in diffs.values()),
    }


def main() -> int:
    args, ds_python, ds_version = setup(__doc__, "deepspeed_layout_check.json")
    results: dict = {"deepspeed_version": ds_version, "zero_to_fp32": "deepspeed/utils/zero_to_fp32.py", "cases": {}}
    with tempfile.TemporaryDirectory(prefix="zerorun-dslayout-") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "zerorun", "--deepspeed-compat", "--num_gpus", "2", "--device", "cpu",
             "tests/compat/_layout_worker.py", str(work), *CASES],
            cwd=ROOT, env=_env(), check=True, capture_output=True, text=True,
        )
        results["train_and_save_s"] = round(time.monotonic() - t0, 1)
        # Run from a copy, as users do (DeepSpeed copies it next to its checkpoints); run in its
        # package directory, its sibling ``types.py`` would shadow the standard library's.
        script = copy_zero_to_fp32(ds_python, work / "deepspeed_zero_to_fp32.py")
        for case in CASES:
            ckpt = work / case
            ds_out = work / f"{case}-ds"
            ds = subprocess.run([str(ds_python), str(script), str(ckpt), str(ds_out)],
                                env=_env(), capture_output=True, text=True)
            entry: dict = {"files": sorted(p.name for p in (ckpt / "global_step3").iterdir())}
            if ds.returncode != 0:
                entry["error"] = (ds.stderr or "")[-2000:]
            else:
                entry.update(compare(ds_out / "pytorch_model.bin", ckpt))
            results["cases"][case] = entry
            print(case, {k: v for k, v in entry.items() if k != "files"})
    results["all_identical"] = all(c.get("identical") for c in results["cases"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

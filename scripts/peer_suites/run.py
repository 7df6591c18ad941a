"""Run the peer DeepSpeed test suites (Hugging Face transformers' and accelerate's) under
zerorun's DeepSpeed compatibility layer on a CPU rank.

    .venv/bin/python scripts/peer_suites/run.py --suites ../shared/peer-suites [--out DIR] [--only accelerate]

``--suites`` (default: ``$ZERORUN_PEER_SUITES``) is a directory holding unmodified copies of the
suites (``transformers/`` and ``accelerate/``, as in the workplace's shared/peer-suites; never
copied into this repository). Each suite runs as a new user would run it with DeepSpeed, with
the ``deepspeed`` command replaced by zerorun's::

    zerorun --deepspeed-compat --num_gpus 1 --device cpu --no-local-rank -m pytest -p zerorun_peer_plugin FILES

with random same-architecture stand-ins for the hub models (standins.py, written into a
private ``HF_HUB_CACHE``; offline) and the GPU-only gates lifted where the test is meaningful
on CPU (gates.py, with every gate lifted and kept and every deselected or known-failing test
and its reason). Writes ``OUT/<suite>.xml`` (junit) and ``OUT/summary.json``; exits 1 when a test
fails that gates.KNOWN_FAILING does not list (a regression, or an upstream change).

``--device cuda`` runs them on one GPU as they are: no ``--device cpu``, no gate lifted and no
probe answered (the plugin only writes the stand-ins and deselects gates.DESELECTED);
scripts/peer_suites/gpu.sh runs it that way on a machine without network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import gates  # noqa: E402

# What runs of each suite (paths inside the suite's directory).
SUITES: dict[str, list[str]] = {
    "accelerate": ["tests/deepspeed"],
    "transformers": ["tests/trainer/distributed/test_trainer_distributed_deepspeed.py"],
}


# Relative run time of each suite (CPU: accelerate ~1/3 of transformers), for --deadline's shares.
_SHARE = {"accelerate": 1.0, "transformers": 2.0}


def _env(hub_cache: Path, device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "ACCELERATE_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
        # The caller's PYTHONPATH stays behind ours (gpu.sh's --target site of carried wheels).
        PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        # Tests that spawn `accelerate`/`torchrun` find this environment's commands.
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env[gates.LIFT_ENV] = "0"
    return env


def summarize(junit: Path) -> dict:
    """Counts and the failing tests ("file::Class::test") of a junit file."""
    out: dict = {"passed": 0, "failed": 0, "skipped": 0, "failures": {}, "skip_reasons": {}}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = [child.tag for child in case]
        if "failure" in kinds or "error" in kinds:
            out["failed"] += 1
            bad = next(child for child in case if child.tag in ("failure", "error"))
            out["failures"][name] = (bad.get("message") or "").splitlines()[0][:300] if bad.get("message") else bad.tag
        elif "skipped" in kinds:
            out["skipped"] += 1
            why = next(child for child in case if child.tag == "skipped").get("message") or "?"
            out["skip_reasons"][why] = out["skip_reasons"].get(why, 0) + 1
        else:
            out["passed"] += 1
    return out


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def run_suite(suite: str, suites_dir: Path, out: Path, hub_cache: Path, timeout: float, device: str = "cpu") -> dict:
    junit = out / f"{suite}.xml"
    cmd = [
        sys.executable, "-m", "zerorun", "--deepspeed-compat", "--num_gpus", "1",
        *(["--device", "cpu"] if device == "cpu" else []), "--no-local-rank", "-m", "pytest", "-p", "zerorun_peer_plugin", "-p", "no:cacheprovider", "-q",
        "-rfEs", f"--junitxml={junit}", *SUITES[suite],
    ]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=suites_dir / suite, env=_env(hub_cache, device), capture_output=True,
                              text=True, timeout=timeout)
        (out / f"{suite}.log").write_text(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as exc:
        (out / f"{suite}.log").write_text(_text(exc.stdout) + _text(exc.stderr) + f"\n[run.py] stopped after {timeout:.0f} s\n")
        return {"error": f"stopped after {timeout:.0f} s; see {out / f'{suite}.log'}",
                "seconds": round(time.monotonic() - t0, 1)}
    if not junit.is_file():
        return {"error": f"no junit output (exit {proc.returncode}); see {out / f'{suite}.log'}",
                "seconds": round(time.monotonic() - t0, 1)}
    result = summarize(junit)
    result["seconds"] = round(time.monotonic() - t0, 1)
    known = gates.KNOWN_FAILING.get(suite, {})
    result["unexpected_failures"] = sorted(n for n in result["failures"] if n not in known)
    result["known_failures_now_passing"] = sorted(n for n in known if n not in result["failures"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", type=Path, default=os.environ.get("ZERORUN_PEER_SUITES"))
    parser.add_argument("--out", type=Path, default=None, help="junit files and summary.json (default: a temp dir)")
    parser.add_argument("--only", choices=sorted(SUITES), action="append")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per suite")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: one CPU rank, GPU-only gates lifted (gates.py); cuda: one GPU, nothing lifted")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for all suites together: each suite gets its share of what is left")
    args = parser.parse_args(argv)
    if args.suites is None or not Path(args.suites).is_dir():
        parser.error("give --suites DIR or set ZERORUN_PEER_SUITES to the directory holding transformers/ and accelerate/")
    out = args.out or Path(tempfile.mkdtemp(prefix="zerorun-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    start = time.monotonic()
    chosen = args.only or sorted(SUITES)
    with tempfile.TemporaryDirectory(prefix="zerorun-hub-") as hub:
        for index, suite in enumerate(chosen):
            timeout = args.timeout
            if args.deadline is not None:
                left = args.deadline - (time.monotonic() - start)
                timeout = min(timeout, max(left * _SHARE[suite] / sum(_SHARE[s] for s in chosen[index:]), 1.0))
            summary[suite] = run_suite(suite, Path(args.suites).resolve(), out, Path(hub), timeout, args.device)
            shown = {k: v for k, v in summary[suite].items() if k not in ("failures", "skip_reasons")}
            print(f"{suite}: {json.dumps(shown)}", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"junit files and summary.json in {out}")
    bad = any("error" in s or s["unexpected_failures"] for s in summary.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The peer DeepSpeed suites (transformers' Trainer DeepSpeed tests, accelerate's tests/deepspeed),
# unmodified, under zerorun's layer on ONE GPU of a machine without network (issue 13):
#
#   zerorun --deepspeed-compat --num_gpus 1 --no-local-rank -m pytest ...   (run.py --device cuda)
#
# Nothing is lifted there (no gate, no probe): the plugin only writes the random hub stand-ins and
# deselects gates.DESELECTED (network). Results: $OUT/{accelerate,transformers}.xml (junit),
# $OUT/{accelerate,transformers}.log, $OUT/summary.json, $OUT/gpu.log (this script's own log with the
# versions used). Ends within DEADLINE seconds (default 480).
#
# What it needs beside the repo (prepared here, carried there; both folders are git-ignored through
# .git/info/exclude, never committed):
#   .whl-peer/   transformers, accelerate, datasets, parameterized, pytest, pydantic and their pure or
#                cp312 dependencies, ~29 MiB (scripts/peer_suites/wheels.sh downloads them); the machine's
#                own torch, numpy, pyarrow, pandas, typer, rich and pyyaml are used
#   .peer-suites/  a copy of ../shared/peer-suites (the unmodified suites; not in the repo)
#
# On the lead's machine:   bash scripts/peer_suites/wheels.sh     (the wheels, and the suites copied into .peer-suites)
# On the GPU (one call):   carry [.whl-peer, .peer-suites], command: bash scripts/peer_suites/gpu.sh
# Dry run on a CPU here:   DEVICE=cpu PYTHON=/path/to/a/bare/python3 OUT=/tmp/o bash scripts/peer_suites/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/peer_gpu_out}"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
DEADLINE="${DEADLINE:-480}"
SUITES="${SUITES:-$PWD/.peer-suites}"
SITE="${PEER_SITE:-/tmp/zerorun-peer-site}"
mkdir -p "$OUT"
log="$OUT/gpu.log"
exec > >(tee "$log") 2>&1
t0=$SECONDS

for need in .whl-peer "$SUITES/transformers" "$SUITES/accelerate"; do
  [[ -d "$need" ]] || { echo "gpu.sh: $need is missing (see the header of scripts/peer_suites/gpu.sh)"; exit 2; }
done
# Never two versions of one distribution (pip would stop the whole install).
dupes=$(ls .whl-peer/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[[ -z "$dupes" ]] || { echo "gpu.sh: two wheels of: $dupes"; exit 2; }

rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  .whl-peer/*.whl || { echo "gpu.sh: installing the wheels failed"; exit 2; }
# The carried wheels come before the machine's site-packages; their commands (accelerate, ...) on PATH.
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
echo "installed $(ls .whl-peer/*.whl | wc -l) wheels into $SITE in $((SECONDS - t0)) s"

"$PY" - <<'EOF' || { echo "gpu.sh: the environment is incomplete (above)"; exit 2; }
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
bad = []
for name in ("torch", "numpy", "pyarrow", "pandas", "typer", "rich", "yaml", "pydantic", "transformers",
             "accelerate", "datasets", "parameterized", "pytest", "huggingface_hub", "tokenizers", "safetensors"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name} {getattr(mod, '__version__', '?')} ({mod.__file__})")
    except Exception as exc:  # noqa: BLE001 - report every missing package at once
        bad.append(f"{name}: {type(exc).__name__}: {exc}")
import torch
print("  cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for line in bad:
    print("MISSING", line)
sys.exit(1 if bad else 0)
EOF
[[ "$DEVICE" == cuda ]] && { nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true; }

left=$((DEADLINE - (SECONDS - t0)))
"$PY" scripts/peer_suites/run.py --suites "$SUITES" --out "$OUT" --device "$DEVICE" --deadline "$left"
rc=$?
echo "gpu.sh: run.py exit $rc after $((SECONDS - t0)) s (1: a failure gates.KNOWN_FAILING does not list; see summary.json)"
exit $rc

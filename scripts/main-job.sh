#!/usr/bin/env bash
# The main job, from a fresh machine: set-up (idempotent), then a real multi-rank training run
# (CPU ranks on gloo where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# A real 2-rank ZeRO-2 training run of the GPT example (tiny size: finishes in well under a
# minute on CPU ranks; bigger sizes with --size on GPUs). --lr replaces the template's
# fine-tuning learning rate (2e-5, 100 warmup steps) so 20 steps visibly learn.
exec .venv/bin/zerorun --num_gpus 2 examples/gpt.py --config templates/zero2.yaml --steps 20 --lr 3e-3 "$@"

#!/usr/bin/env bash
# The main job, from a fresh machine: set-up (idempotent), then a real multi-rank training run
# (CPU ranks on gloo where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/zerorun print-config templates/zero2.yaml "$@"

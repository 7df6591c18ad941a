#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set-up (idempotent) + lint + pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --system
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
.venv/bin/ruff check zerorun tests benchmarks examples
exec .venv/bin/python -m pytest -q "$@"

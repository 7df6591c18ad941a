#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set-up (idempotent) + lint + type check + pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --system
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
.venv/bin/ruff check zerorun tests benchmarks examples
.venv/bin/mypy  # zerorun/runtime, configured in pyproject.toml
exec .venv/bin/python -m pytest -q "$@"

#!/usr/bin/env bash
# The CPU Adam kernel A/B on the GPU machine (docs/offload.md, "The CPU kernel"): the same offload
# rows with torch's fused kernel and fp32 gradients (ZERORUN_CPU_KERNEL=0), zerorun's kernel split
# by OpenMP (omp) and over its thread pool (threads, the default), in one run on one machine, after
# the no-offload baselines. Each mode's records go to $OUT/kernel_<mode>/ (results.jsonl, log.txt).
#
#   OUT=/tmp/ab bash benchmarks/cpu_kernel_ab.sh [configs]     # default: the exact and delayed rows
set -euo pipefail
VAR=ZERORUN_CPU_KERNEL VALUES="0 omp threads" PREFIX=kernel exec bash "$(dirname "$0")/env_ab.sh" "$@"

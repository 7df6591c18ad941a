#!/usr/bin/env bash
# The CPU Adam kernel A/B on the GPU machine (docs/offload.md, "The CPU kernel"): the same offload
# rows with torch's fused kernel and fp32 gradients (ZERORUN_CPU_KERNEL=0), zerorun's kernel split
# by OpenMP (omp) and over its thread pool (threads, the default), in one run on one machine, after
# the no-offload baselines. Each mode's records go to $OUT/kernel_<mode>/ (results.jsonl, log.txt).
#
#   OUT=/tmp/ab bash benchmarks/cpu_kernel_ab.sh [configs]     # default: the exact and delayed rows
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
CFGS=${1:-zero2_offload_opt,zero3_offload_opt,zero2_offload_dpu}
BUDGET=${BUDGET_S:-540}
start=$SECONDS
for mode in 0 omp threads; do
  cfgs=$CFGS
  [[ $mode == 0 ]] && cfgs=zero2,zero3,$CFGS
  mkdir -p "$OUT/kernel_$mode"
  ZERORUN_CPU_KERNEL=$mode SIZE=${SIZE:-1.3B} BUDGET_S=$((BUDGET - (SECONDS - start))) TIMEOUT_S=${TIMEOUT_S:-50} \
    OUT="$OUT/kernel_$mode" bash benchmarks/run_gpu.sh "$cfgs" --no-baseline-repeat > "$OUT/kernel_$mode.log" 2>&1
  echo "== ZERORUN_CPU_KERNEL=$mode"
  grep -A8 "^config " "$OUT/kernel_$mode.log" || tail -5 "$OUT/kernel_$mode.log"
done

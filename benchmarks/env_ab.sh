#!/usr/bin/env bash
# The same 1.3B offload rows under several values of one environment variable, in one run on one
# machine (the rows vary by up to 10 % between machines, so an A/B must share one), after the
# no-offload baselines. Each value's records go to $OUT/<prefix>_<value>/ (results.jsonl, log.txt).
#
#   VAR=ZERORUN_HUGEPAGES VALUES="0 1" OUT=/tmp/ab bash benchmarks/env_ab.sh [configs]
#   (PREFIX: the folders' prefix, default $VAR; BASELINES: run first, with the first value,
#   default zero2,zero3; SIZE, BUDGET_S, TIMEOUT_S: as benchmarks/run_gpu.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
VAR=${VAR:?set VAR, the environment variable to vary}
VALUES=${VALUES:?set VALUES, its values (space-separated)}
PREFIX=${PREFIX:-$VAR}
CFGS=${1:-zero2_offload_opt,zero3_offload_opt,zero2_offload_dpu}
BASELINES=${BASELINES-zero2,zero3}
BUDGET=${BUDGET_S:-540}
start=$SECONDS
first=1
for value in $VALUES; do
  cfgs=$CFGS
  [[ $first == 1 && -n $BASELINES ]] && cfgs=$BASELINES,$CFGS
  first=0
  dir="$OUT/${PREFIX}_$value"
  mkdir -p "$dir"
  env "$VAR=$value" SIZE="${SIZE:-1.3B}" BUDGET_S=$((BUDGET - (SECONDS - start))) TIMEOUT_S="${TIMEOUT_S:-50}" \
    OUT="$dir" bash benchmarks/run_gpu.sh "$cfgs" --no-baseline-repeat > "$dir.log" 2>&1 || echo "($VAR=$value: run_gpu.sh failed)"
  echo "== $VAR=$value"
  grep -A8 "^config " "$dir.log" || tail -5 "$dir.log"
done

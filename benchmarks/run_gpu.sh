#!/usr/bin/env bash
# The benchmark on the GPU machine, in one call. From the repository root:
#
#   OUT=/some/dir bash benchmarks/run_gpu.sh SET [extra train_bench.py options]
#
# SET: quick  (plain, FSDP2, zerorun stage 2, plain again)            ~2-3 min on one H200
#      full   (every configuration that applies to NPROC)             ~6-9 min on one H200
#      memory (zerorun stages 1-3 + offload, NPROC ranks sharing GPU 0 over gloo; 350M model by default)
#      a comma list of configurations/presets, e.g. quick,zero3
# Environment: SIZE (default 1.3B), NPROC (1; memory: 4), TIMEOUT_S (deadline per configuration),
# ZERORUN_BENCH_COMMIT (the commit to record when the tree is a copy without its own .git), BUDGET_S (the whole run; what does not fit is recorded as not_run; default 540 s so a
# 600 s call still prints its table), PYTHON (python3).
# Files left in $OUT (a few, so they all come back): results.jsonl (every record, appended as
# each configuration finishes), RESULTS.md (this run's tables), log.txt (everything printed).
# Back home: python benchmarks/report.py --import-bundle <files>/results.jsonl
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory whose files come back}"
# NVLink multicast stays off on these machines (it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

# Wheels the GPU image lacks (pydantic, paramiko, ...), carried in .whl/ by the caller.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zr-site .whl/*.whl \
    && export PYTHONPATH=/tmp/zr-site${PYTHONPATH:+:$PYTHONPATH}
fi

set_name=${1:-quick}
shift || true
mode=throughput
nproc=${NPROC:-1}
extra=()
case "$set_name" in
  memory)
    mode=memory
    nproc=${NPROC:-4}
    configs=memory
    # Three steps are enough for memory at rest (optimizer states exist after the first).
    extra=(--ranks-per-gpu "$nproc" --warmup 1 --steps 2)
    per=${TIMEOUT_S:-200}
    # 350M by default: gloo moves every gradient through the host, so 4 ranks x 1.3B take
    # minutes per configuration; the formulas are per parameter. SIZE=1.3B for the reference.
    SIZE=${SIZE:-350M}
    ;;
  *)
    configs=$set_name
    per=${TIMEOUT_S:-150}
    ;;
esac

results=$(mktemp -d /tmp/zr-bench-results.XXXX)  # one JSON per configuration: too many files to all come back
mkdir -p "$OUT"
{
  echo "== $(date -u +%FT%TZ) run_gpu.sh $set_name size=${SIZE:-1.3B} nproc=$nproc mode=$mode"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/log.txt"

"$PY" benchmarks/train_bench.py --size "${SIZE:-1.3B}" --configs "$configs" --mode "$mode" \
  --nproc "$nproc" --timeout-s "$per" --budget-s "${BUDGET_S:-540}" \
  --out "$results" --bundle "$OUT/results.jsonl" "${extra[@]}" "$@" 2>&1 | tee -a "$OUT/log.txt"
status=${PIPESTATUS[0]}

"$PY" benchmarks/report.py --results "$results" --out "$OUT/RESULTS.md" 2>&1 | tee -a "$OUT/log.txt"
exit "$status"

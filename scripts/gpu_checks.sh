#!/usr/bin/env bash
# Runtime checks on a GPU machine (the lead runs this on the H200 box).
#
#   1. the stage 0/1/2 equivalence matrix with CUDA tensors, world 1 on NCCL, with
#      ZERORUN_DEBUG_COLLECTIVES=1 so the one-rank collectives really run on the side stream;
#   2. the same matrix with 2 and 4 ranks sharing the one GPU over gloo (--ranks_per_gpu mode);
#   3. examples/gpt.py through the launcher: 1 rank on the GPU (NCCL), and 2 ranks sharing it;
#   4. the ZeRO stage 3 tests the same two ways; 5. stage-3 memory at rest per rank vs 16Ψ/N;
#   6. the delayed parameter update against its one-step-delayed reference, step by step, in the
#      configuration that did not learn on the GPU (issue 20: GPT, many flat buffers x tiles,
#      worker thread, LR scheduler, warm-up, no host sync between steps): 2 ranks sharing the GPU
#      at stages 1-3 x clip on/off x bf16/fp16, and world 1 on NCCL with a 134M-parameter GPT;
#   7. torch.compile: stages 0-3 and offload with compiled blocks (inductor, aot_eager) and
#      engine.compile(), losses and parameters against the uncompiled run, compiles counted
#      (2 ranks sharing the GPU; world 1 on NCCL with the collectives forced). One inductor
#      cache (TORCHINDUCTOR_CACHE_DIR) is shared by every group.
#
# Results (logs, junit XML, a summary) go under $OUT (default ./gpu_checks_out). Needs torch with
# CUDA, pytest, and zerorun's dependencies (pydantic, typer, rich, pyyaml; paramiko is not used
# here). PYTHON selects the interpreter (default: python3).
#
# Bounded: each group has its own limit and all of them share GPU_CHECKS_BUDGET seconds (default
# 1200): a group gets what is left, a group with under 20 s left is skipped (said in the summary),
# so the script ends in about 20 minutes even when something hangs. Where one call is limited to
# 10 minutes, run it in two parts with GPU_CHECKS_ONLY (docs/gpu-verification.md says which). pytest prints every failure's
# short traceback and the list of failures (-rf --tb=short) into the group's log, whose last 40
# lines also go to the summary when the group fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_checks_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
# ZR_TEST_DEADLINE: one multi-rank launch inside a test (a hang ends there, with every rank's output).
export CUBLAS_WORKSPACE_CONFIG=:4096:8 ZERORUN_TEST_DEVICE=cuda ZERORUN_RANKS_PER_GPU=4 ZR_TEST_DEADLINE=100
BUDGET="${GPU_CHECKS_BUDGET:-1200}"
# One compile cache for every group: a block compiled once is reused (inductor's graph cache).
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/zr-gpu-checks-inductor}"
# GPU_CHECKS_ONLY=eq_world1_nccl,offload_shared_gloo runs only the named groups.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rf --tb=short)
summary="$OUT/summary.txt"
: >"$summary"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' \
  | tee -a "$summary"

run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, one line per step in the summary
  local name=$1 limit=$2; shift 2
  if [[ -n "${GPU_CHECKS_ONLY:-}" && ",$GPU_CHECKS_ONLY," != *",$name,"* ]]; then
    return 0  # not selected (GPU_CHECKS_ONLY=name,name,...)
  fi
  local left=$((BUDGET - SECONDS))
  if ((left < 20)); then
    echo "$name: SKIPPED (GPU_CHECKS_BUDGET=$BUDGET s spent)" | tee -a "$summary"
    return 0
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local why=""
  ((rc == 124 || rc == 137)) && why=" (TIMEOUT after $limit s)"
  echo "$name: exit $rc$why in $((SECONDS - t0)) s -- $(tail -n 1 "$OUT/$name.log")" | tee -a "$summary"
  if ((rc != 0)); then
    tail -n 40 "$OUT/$name.log" | sed "s/^/    $name| /" >>"$summary"
  fi
  return 0
}

# 1. world 1 on NCCL, collectives forced through the CUDA stream path.
run eq_world1_nccl 60 env ZERORUN_BACKEND=nccl ZERORUN_DEBUG_COLLECTIVES=1 \
  "${PYTEST[@]}" tests/runtime/test_equivalence.py -k "w1 and not golden" \
  --junitxml="$OUT/eq_world1_nccl.xml"
# 2. 2 and 4 ranks sharing the GPU over gloo (host-staged collectives, stream/event ordering).
run eq_shared_gloo 90 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/test_equivalence.py -k "(w2 or w4) and not golden" \
  --junitxml="$OUT/eq_shared_gloo.xml"
# 2b. offload (docs/offload.md): the CUDA copy path -- pinned host buffers, D2H of gradient tiles
#     and H2D of parameter tiles on side streams ordered by events, the worker thread's step, the
#     delayed update, stage-3 parameter fetches from the host -- against the same references.
#     World 1 on NCCL, then 2 ranks sharing the GPU over gloo (+ checkpoint resume). The NVMe
#     cases use pytest's temp dir: TMPDIR on a local disk exercises direct I/O.
run offload_world1_nccl 90 env ZERORUN_BACKEND=nccl \
  "${PYTEST[@]}" tests/runtime/test_offload.py -k "w1" \
  --junitxml="$OUT/offload_world1_nccl.xml"
run offload_shared_gloo 120 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/test_offload.py -k "not w1" \
  --junitxml="$OUT/offload_shared_gloo.xml"
run offload_units 40 "${PYTEST[@]}" tests/runtime/test_offload_units.py tests/runtime/test_offload_host.py \
  --junitxml="$OUT/offload_units.xml"
# 2b''. bf16 gradients on the wire (options.narrow_grads): cast on the GPU, copied down as bf16,
#      stepped by the one-pass CPU kernel (built here with the host's compiler) -- bitwise the same
#      training as fp32 gradients with torch's kernel, stages 1-3, parameter offload, delayed update;
#      the kernel's C thread pool (pinned, and after a fork).
run offload_narrow 60 env ZERORUN_BACKEND=nccl \
  "${PYTEST[@]}" tests/runtime/test_offload_narrow.py tests/runtime/test_cpu_kernel_pin.py \
  --junitxml="$OUT/offload_narrow.xml"
# 2b'. the exact step's deferred write-backs (issue 17): the next forward starts on the buffers it
#      needs first while the CPU steps the rest -- the order proved with the placement's own events
#      (world 1 on the GPU, and 2 ranks sharing it over gloo: stages 1-2 there defer nothing).
run exact_overlap 120 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/test_offload_exact_overlap.py \
  --junitxml="$OUT/exact_overlap.xml"
# 2b-iv. stage 3's persistent group (norms, biases) deferred at one rank: step() returns with its
#        write-back in flight (a held worker proves it), readers wait for it.
run s3_persistent 60 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/test_offload_s3_persistent.py --junitxml="$OUT/s3_persistent.xml"
# 2c. ZenFlow against its reference (world 1 and 2 ranks sharing the GPU, a checkpoint saved
#     mid-interval) and wall_clock_breakdown's offload sub-phases (copy-stream timing events).
run zenflow_breakdown 150 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/test_offload_zenflow.py tests/runtime/test_offload_breakdown.py \
  --junitxml="$OUT/zenflow_breakdown.xml"
# 3. the README's example through the launcher.
run gpt_1gpu_nccl 60 "$PY" -m zerorun --num_gpus 1 examples/gpt.py --config templates/zero2.yaml --size 125M --seq_len 1024 --steps 30 --lr 6e-4
run gpt_2ranks_shared 45 "$PY" -m zerorun --num_gpus 2 --ranks_per_gpu 2 examples/gpt.py --config templates/zero2.yaml --steps 20 --lr 3e-3
# 4. ZeRO stage 3: world 1 on NCCL (collectives forced through the stream path), 2 and 4 ranks
#    sharing the GPU over gloo (prefetched all-gathers and reduce-scatters on the side stream).
run s3_world1_nccl 45 env ZERORUN_BACKEND=nccl ZERORUN_DEBUG_COLLECTIVES=1 ZR_S3_WORLDS=1 \
  "${PYTEST[@]}" tests/runtime/test_stage3.py --junitxml="$OUT/s3_world1_nccl.xml"
run s3_shared_gloo 90 env ZERORUN_BACKEND=gloo ZR_S3_WORLDS=2,4 \
  "${PYTEST[@]}" tests/runtime/test_stage3.py --junitxml="$OUT/s3_shared_gloo.xml"
# 5. stage-3 memory at rest per rank (torch.cuda.memory_allocated) vs 16Ψ/N: JSON in $OUT/s3_memory_w*.json
run s3_memory_w1 40 env OUT="$OUT" "$PY" -m zerorun --num_gpus 1 tests/runtime/_s3_gpu_memory.py --size 350M
run s3_memory_w4 60 env OUT="$OUT" "$PY" -m zerorun --num_gpus 4 --ranks_per_gpu 4 tests/runtime/_s3_gpu_memory.py --size 350M
# 5b. stage 3 + offload: initialize's GPU peak has no 4 B/param fp32-master term (320M GPT; cpu/nvme masters,
#     zero.Init, parameters on the GPU); the master shards are cut on the host one group at a time (2 ranks sharing).
run s3_init_peak 150 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/benchmarks/test_largest_model_init.py tests/runtime/test_stage3_build.py \
  --junitxml="$OUT/s3_init_peak.xml"
# 6. The delayed parameter update (issue 20) against the one-step-delayed reference: the CUDA copy
#    path (pinned tiles, side streams, events, the worker thread) in the triggering configuration.
run dpu_shared_gloo 150 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/test_offload_delayed.py --junitxml="$OUT/dpu_shared_gloo.xml"
dpu_big="z2-bf16-clip0-warm0,z2-fp16-clip0.5-warm2,z3-bf16-clip0.5-warm2,z1-bf16-clip0-warm2"
run dpu_125M_world1_nccl 150 env ZERORUN_BACKEND=nccl ZR_DPU_WORLD=1 ZR_DPU_SIZE=125M ZR_DPU_STEPS=8 \
  ZR_DPU_CASES="$dpu_big" "${PYTEST[@]}" tests/runtime/test_offload_delayed.py -k "${dpu_big//,/ or }" \
  --junitxml="$OUT/dpu_125M_world1_nccl.xml"
# 7. torch.compile with every stage and offload mode (issue 20).
run compile_shared_gloo 240 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/test_compile.py --junitxml="$OUT/compile_shared_gloo.xml"
run compile_world1_nccl 150 env ZERORUN_BACKEND=nccl ZERORUN_DEBUG_COLLECTIVES=1 ZR_COMPILE_WORLD=1 \
  "${PYTEST[@]}" tests/runtime/test_compile.py --junitxml="$OUT/compile_world1_nccl.xml"
# 8. Observability and activation checkpointing (issue 18): CUDA-event timers, MFU against the GPU's
#    peak, the live status's loss read without a host sync (sync debug mode "error"), pinned-host
#    activation stashes with side-stream prefetch, the partition all-gather.
run observe_cuda 150 env ZERORUN_BACKEND=gloo \
  "${PYTEST[@]}" tests/runtime/observe tests/runtime/activations --junitxml="$OUT/observe_cuda.xml"
echo "results in $OUT" | tee -a "$summary"

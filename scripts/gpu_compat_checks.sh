#!/usr/bin/env bash
# DeepSpeed-compatibility checks on a GPU machine (the lead runs this on the H200 box; issue 9).
#
#   1. the compat test suite (tests/compat) on the GPU: the Trainer cases run world 1 on NCCL
#      there (accelerate picks CUDA), the ToyModel and ZeRO-3 from_pretrained launches 2 ranks;
#   2. examples/hf_trainer.py (HF Trainer, --deepspeed) world 1 on NCCL, bf16: ZeRO-2, ZeRO-3,
#      ZeRO-3 + CPU optimizer offload; then the ZeRO-3 run resumed from its last checkpoint;
#   3. the same Trainer job with 2 ranks sharing the GPU (--ranks_per_gpu 2, gloo): ZeRO-2, ZeRO-3;
#   4. examples/ds_toy.py (the article's DeepSpeed script, unchanged): 1 rank on NCCL, 2 sharing.
#
# Results (logs, metrics.json of every Trainer run, junit XML, a summary) go under $OUT (default
# ./gpu_compat_out). Needs torch with CUDA, transformers >= 5 and accelerate, pytest, and
# zerorun's dependencies (pydantic, typer, rich, pyyaml; paramiko is not used here). PYTHON
# selects the interpreter (default: python3). Nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_compat_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
summary="$OUT/summary.txt"
: >"$summary"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name(0), "transformers", transformers.__version__, "accelerate", accelerate.__version__)' \
  | tee -a "$summary"

run() {  # run NAME CMD...: log to $OUT/NAME.log, one line per step in the summary
  local name=$1; shift
  local t0=$SECONDS
  timeout 900 "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s -- $(grep -h '"train_loss"' "$OUT/$name.log" | tail -n 1 || true)" \
    | tee -a "$summary"
  return 0
}

cfg_dir="$OUT/configs"
mkdir -p "$cfg_dir"
write_cfg() {  # write_cfg NAME ZERO_SECTION_JSON: a Trainer config with every batch/precision key auto
  cat >"$cfg_dir/$1.json" <<EOF
{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
 "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
 "zero_optimization": $2}
EOF
}
write_cfg zero2 '{"stage": 2}'
write_cfg zero3 '{"stage": 3, "stage3_gather_16bit_weights_on_model_save": true}'
write_cfg zero3_offload '{"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": true}'
printf '{"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2, "bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}\n' \
  >"$cfg_dir/toy.json"

# 1. the compat tests on this machine.
run compat_tests "$PY" -m pytest -q -p no:cacheprovider tests/compat --junitxml="$OUT/compat_tests.xml"

trainer_args=(--do_eval --bf16 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --learning_rate 3e-3
  --logging_steps 5 --save_steps 20 --report_to none --disable_tqdm true --n_layer 4 --n_embd 256 --n_head 4
  --block_size 128 --train_file README.md)
# 2. world 1 on NCCL.
for cfg in zero2 zero3 zero3_offload; do
  run "trainer_1gpu_$cfg" "$PY" -m zerorun --deepspeed-compat --num_gpus 1 examples/hf_trainer.py \
    --deepspeed "$cfg_dir/$cfg.json" --output_dir "$OUT/trainer_1gpu_$cfg" --max_steps 40 "${trainer_args[@]}"
done
run trainer_1gpu_zero3_resumed "$PY" -m zerorun --deepspeed-compat --num_gpus 1 examples/hf_trainer.py \
  --deepspeed "$cfg_dir/zero3.json" --output_dir "$OUT/trainer_1gpu_zero3" --max_steps 60 "${trainer_args[@]}"
# 3. two ranks sharing the GPU (gloo; accelerate's own collectives -- the token count gathered
#    every step, the eval gather -- then carry CUDA tensors over gloo). Training + save + resume
#    first, then the same with evaluation.
for cfg in zero2 zero3; do
  run "trainer_2ranks_shared_$cfg" "$PY" -m zerorun --deepspeed-compat --num_gpus 2 --ranks_per_gpu 2 \
    examples/hf_trainer.py --deepspeed "$cfg_dir/$cfg.json" --output_dir "$OUT/trainer_2ranks_shared_$cfg" \
    --max_steps 40 "${trainer_args[@]:1}"
  run "trainer_2ranks_shared_${cfg}_resumed_eval" "$PY" -m zerorun --deepspeed-compat --num_gpus 2 --ranks_per_gpu 2 \
    examples/hf_trainer.py --deepspeed "$cfg_dir/$cfg.json" --output_dir "$OUT/trainer_2ranks_shared_$cfg" \
    --max_steps 60 "${trainer_args[@]}"
done
# 4. the article's DeepSpeed script, unchanged.
run ds_toy_1gpu_nccl "$PY" -m zerorun --deepspeed-compat --num_gpus 1 examples/ds_toy.py \
  --deepspeed_config "$cfg_dir/toy.json" --hidden 1024 --layers 12 --samples 1000 --out "$OUT/ds_toy_1gpu"
run ds_toy_2ranks_shared "$PY" -m zerorun --deepspeed-compat --num_gpus 2 --ranks_per_gpu 2 examples/ds_toy.py \
  --deepspeed_config "$cfg_dir/toy.json" --hidden 1024 --layers 12 --samples 1000 --out "$OUT/ds_toy_2ranks"

for d in "$OUT"/trainer_*/; do
  [[ -f "$d/metrics.json" ]] && "$PY" -c 'import json, sys; m = json.load(open(sys.argv[1]));
print(sys.argv[1], "eval_loss", m.get("eval_loss"), "train_loss", round(m["train_loss"], 4), "resumed_from", m["resumed_from"])' \
    "$d/metrics.json" | tee -a "$summary"
done
echo "done; see $summary" | tee -a "$summary"

"""Hugging Face Trainer through zerorun's DeepSpeed layer, one process, many cases.

    python tests/compat/_trainer_worker.py WORKDIR CASE [CASE ...]

A case is ``plain`` (Trainer without DeepSpeed: the reference), ``article`` (the article's
section 3.3 ds_config.json file) or ``s{stage}-{hf|cfg}[-cpu|-nvme][-param][-resume]``: ZeRO stage, optimizer built by the Trainer
(``hf``) or from the config's ``optimizer`` section (``cfg``), optimizer offload to CPU or NVMe
(a directory), stage-3 parameter offload to CPU, and a second run that resumes from the first
run's ``checkpoint-2``. Every case trains the same tiny GPT-2 (built from
a config, saved once, loaded with ``from_pretrained``: under stage 3 through ``zero.Init``) for
one epoch of 5 micro-batches with accumulation 2 (windows of 2, 2 and a short 1), evaluates,
and saves the model. Results go to WORKDIR/CASE.json; at the end every saved model is
reloaded with ``from_pretrained`` (no DeepSpeed) and compared with the reference's, and the
layer's misses (deepspeed symbols asked for and not provided) are written to misses.json.
Cases share the process because importing transformers costs ~10 s on these machines.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(_name, None)

import zerorun.compat  # noqa: E402

zerorun.compat.activate()

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

SEQ = 16
VOCAB = 128


class RandomTokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model_dir(work: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    path = work / "tiny-gpt2"
    if not path.exists():
        torch.manual_seed(0)
        cfg = GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def ds_config(
    stage: int, optimizer_from_config: bool, offload: str | None, offload_param: bool = False, nvme_path: str = ""
) -> dict:
    zero: dict = {"stage": stage}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        zero["stage3_param_persistence_threshold"] = "auto"
        zero["stage3_prefetch_bucket_size"] = "auto"
    cfg: dict = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }
    if optimizer_from_config:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    return cfg


def reset_state() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)


def run(work: Path, case: str) -> dict:
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    parts = case.split("-")
    deepspeed: dict | str | None = None
    if case == "article":
        # The article's section 3.3 ds_config.json with the two edits transformers 5 needs with
        # DeepSpeed too: no `//` comment (accelerate reads plain JSON) and `amp.enabled: false`
        # (nothing fills that `auto` any more).
        deepspeed = str(Path(__file__).with_name("article_ds_config.json"))
        os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    elif case != "plain":
        stage = int(parts[0][1:])
        offload = "cpu" if "cpu" in parts else "nvme" if "nvme" in parts else None
        deepspeed = ds_config(stage, parts[1] == "cfg", offload, "param" in parts, str(work / "nvme"))
        os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    else:
        for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
            os.environ.pop(name, None)
    resume = "resume" in parts
    out = work / case
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        num_train_epochs=1,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps" if resume else "no",
        save_steps=2,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        deepspeed=deepspeed,
    )
    # TrainingArguments first: under stage 3 from_pretrained must see the DeepSpeed config.
    model = GPT2LMHeadModel.from_pretrained(make_model_dir(work))
    result: dict = {"case": case}
    if isinstance(deepspeed, dict) and deepspeed["zero_optimization"]["stage"] == 3:
        # Partitioned by zero.Init inside from_pretrained: this rank holds 1/world of each.
        result["partitioned_at_load"] = all(hasattr(p, "ds_numel") for p in model.parameters())
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(20, 1), eval_dataset=RandomTokens(8, 2))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result["loss"] = [h["loss"] for h in logs]
    result["grad_norm"] = [h["grad_norm"] for h in logs]
    result["lr"] = [h["learning_rate"] for h in logs]
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    if deepspeed is not None:
        engine = trainer.model_wrapped
        result["engine"] = type(engine).__name__
        result["global_steps"] = engine.global_steps
        result["optimizer"] = type(engine.optimizer).__name__
    if resume:
        ckpt = out / "checkpoint-2"
        result["checkpoint_files"] = sorted(p.name for p in ckpt.iterdir())
        result["latest"] = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
        trainer.save_model(str(out / "uninterrupted"))  # the resumed run must end with these weights
        del trainer, model
        reset_state()
        args2 = TrainingArguments(**{**args.to_dict(), "output_dir": str(work / f"{case}-2"), "deepspeed": deepspeed})
        model2 = GPT2LMHeadModel.from_pretrained(make_model_dir(work))
        trainer = Trainer(model=model2, args=args2, train_dataset=RandomTokens(20, 1), eval_dataset=RandomTokens(8, 2))
        trainer.train(resume_from_checkpoint=str(ckpt))
        result["resumed_loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result["resumed_eval_loss"] = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(out / "final"))
    result["final_files"] = sorted(p.name for p in (out / "final").iterdir())
    del trainer
    reset_state()
    return result


def max_diff(a: dict, b: dict, key_biases: bool = True) -> float:
    """max |a - b| over a's tensors; ``key_biases=False`` leaves out the attention key biases
    (the middle third of GPT-2's ``c_attn.bias`` = [query | key | value]): their gradient is
    zero in exact arithmetic (softmax ignores a per-query constant), so what they hold after
    training is rounding noise amplified by Adam (see test_trainer.py)."""
    worst = 0.0
    for k in a:
        d = (b[k].float() - a[k].float()).abs()
        if not key_biases and k.endswith("attn.c_attn.bias"):
            n = d.numel() // 3
            d = torch.cat([d[:n], d[2 * n:]])
        worst = max(worst, d.max().item())
    return worst


def compare_saved(work: Path, cases: list[str]) -> dict:
    """Reload every saved model without DeepSpeed; max |difference| to the plain run's and to
    the stage-0 run's weights (also without the attention key biases), and each resumed run's
    to the same case's uninterrupted first run."""
    from transformers import GPT2LMHeadModel

    reset_state()
    os.environ.pop("LOCAL_RANK", None)
    models = {case: GPT2LMHeadModel.from_pretrained(work / case / "final").state_dict() for case in cases}
    out: dict = {}
    for ref_case in ("plain", "s0-hf"):
        if ref_case not in models:
            continue
        ref = models[ref_case]
        out[ref_case] = {case: max_diff(ref, sd) for case, sd in models.items()}
        out[f"{ref_case} without key biases"] = {case: max_diff(ref, sd, False) for case, sd in models.items()}
    out["resumed vs uninterrupted"] = {
        case: max_diff(GPT2LMHeadModel.from_pretrained(work / case / "uninterrupted").state_dict(), models[case])
        for case in cases
        if "resume" in case.split("-")
    }
    return out


def main() -> None:
    work = Path(sys.argv[1])
    cases = sys.argv[2:]
    for case in cases:
        (work / f"{case}.json").write_text(json.dumps(run(work, case)))
        print(f"case {case} done", flush=True)
    (work / "reload.json").write_text(json.dumps(compare_saved(work, cases)))
    from zerorun.compat.deepspeed._surface import MISSES

    (work / "misses.json").write_text(json.dumps(sorted(set(MISSES))))


if __name__ == "__main__":
    main()

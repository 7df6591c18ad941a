"""One rank of a fault-tolerance test job (tests/runtime/checkpoint/test_fault_tolerance.py,
tests/launch/test_restart.py): trains a small model with the engine's own data loader, with
the checkpoint behaviour of the config in FT_CONFIG (JSON), and a script that knows nothing
about resuming -- zerorun.initialize does that.

FT_OUT: a directory; each rank writes its pid to pid_rank{R} and appends one line per optimizer step to losses_rank{R}.jsonl
({"step", "loss", "resumed_from", "world", "train_batch"}), and at the end every rank joins a final save to
FT_OUT/final (the fp32 masters the tests compare).
FT_STEPS: optimizer steps to train.
FT_KILL=RANK:STEP: that rank SIGKILLs itself after that step, once (FT_OUT/killed marks it).
FT_SYNC_SAVE_AT=STEP: after that step the script also saves synchronously to FT_OUT/sync
(compared with the engine's asynchronous save of the same step).
FT_CRASH_AFTER=STEP: after that step's save, ZERORUN_CHECKPOINT_CRASH is set to FT_CRASH (so
the next save dies where it says).
FT_SLOW=SECONDS: sleep after every step (a preemption test needs time to send its signal).
FT_NO_FINAL=1: no final save and no engine.destroy(): the script ends with destroy_process_group.
FT_COMPAT=1: the same script as a DeepSpeed script (`deepspeed.initialize`, zerorun's compat
layer; the launcher's --deepspeed-compat activates it, or the script does when run bare).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerorun

D_IN, D_H, D_OUT, SAMPLES = 12, 24, 5, 40


def main() -> None:
    cfg = json.loads(os.environ["FT_CONFIG"])
    out = Path(os.environ["FT_OUT"])
    steps = int(os.environ.get("FT_STEPS", "8"))
    kill = os.environ.get("FT_KILL")
    sync_at = int(os.environ.get("FT_SYNC_SAVE_AT", "0"))
    crash_after = int(os.environ.get("FT_CRASH_AFTER", "0"))
    slow = float(os.environ.get("FT_SLOW", "0"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_H), nn.Tanh(), nn.Linear(D_H, D_OUT))
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, D_IN, generator=g), torch.randn(SAMPLES, D_OUT, generator=g))
    if os.environ.get("FT_COMPAT") == "1":
        from zerorun.compat import activate

        activate(announce=False)  # a no-op under zerorun --deepspeed-compat
        import deepspeed

        engine, _opt, loader, _sched = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), training_data=data, config=cfg
        )
        resumed = engine.zerorun_engine.resumed_from
    else:
        engine, _opt, loader, _sched = zerorun.initialize(model=model, training_data=data, config=cfg)
        resumed = engine.resumed_from
    rank = engine.global_rank
    (out / f"pid_rank{rank}").write_text(str(os.getpid()))
    log = open(out / f"losses_rank{rank}.jsonl", "a")  # noqa: SIM115 - closed at exit
    while engine.global_steps < steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            row = {"step": engine.global_steps, "loss": mean.item() / engine.world_size, "resumed_from": resumed}
            log.write(json.dumps({**row, "world": engine.world_size, "train_batch": engine.train_batch_size()}) + "\n")
            log.flush()
            step = engine.global_steps
            if sync_at and step == sync_at:
                engine.save_checkpoint(str(out / "sync"))
            if crash_after and step == crash_after:
                os.environ["ZERORUN_CHECKPOINT_CRASH"] = os.environ["FT_CRASH"]
            if kill:
                who, at = (int(v) for v in kill.split(":"))
                if who == rank and at == step and not (out / "killed").exists():
                    (out / "killed").write_text(str(step))
                    os.kill(os.getpid(), signal.SIGKILL)
            if slow:
                time.sleep(slow)
            if engine.global_steps >= steps:
                break
    if os.environ.get("FT_NO_FINAL") != "1":
        engine.save_checkpoint(str(out / "final"), tag="final")
        engine.destroy()
    # (With FT_NO_FINAL an asynchronous save of the last step may still be writing here:
    # destroy_process_group waits for it.)
    log.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

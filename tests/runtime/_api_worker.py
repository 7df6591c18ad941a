"""zerorun.initialize's behaviours a user meets, checked in one process (argv: OUT_JSON).

Each check returns None (passed) or raises; rank 0 writes {check: "ok" | "FAIL: ..."}.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerorun
from zerorun.errors import RuntimeConfigError

BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 16}}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def cfg(**extra) -> dict:  # noqa: ANN003
    out = copy.deepcopy(BASE)
    out.update(extra)
    return out


def expect_error(fn, *needles: str) -> None:  # noqa: ANN001
    try:
        fn()
    except RuntimeConfigError as exc:
        msg = str(exc)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"message lacks {missing}: {msg}"
        return
    raise AssertionError("no RuntimeConfigError raised")


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)


def train(engine, steps: int, zero_grad_each_micro: bool = False) -> list[float]:  # noqa: ANN001
    losses = []
    for s in range(steps):
        x, y = data(s)
        if zero_grad_each_micro:
            engine.zero_grad()
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def check_no_optimizer() -> None:
    expect_error(lambda: zerorun.initialize(model=model(), config=cfg()), "no optimizer", "optimizer:")


def check_unsupported_optimizer_type() -> None:
    expect_error(
        lambda: zerorun.initialize(
            model=model(), config=cfg(optimizer={"type": "Lamb", "params": {"lr": 1e-3}})
        ),
        "Lamb",
        "AdamW",
    )


def check_non_elementwise_user_optimizer() -> None:
    m = model()
    opt = torch.optim.LBFGS(m.parameters())
    expect_error(
        lambda: zerorun.initialize(model=m, optimizer=opt, config=cfg()),
        "LBFGS",
        "zero_allow_untested_optimizer",
    )
    m = model()
    zerorun.initialize(
        model=m, optimizer=torch.optim.LBFGS(m.parameters()), config=cfg(zero_allow_untested_optimizer=True)
    )[0].destroy()


def check_auto_lr_without_optimizer() -> None:
    expect_error(
        lambda: zerorun.initialize(
            model=model(), config=cfg(optimizer={"type": "AdamW", "params": {"lr": "auto"}})
        ),
        "optimizer.params.lr",
    )


def check_fp16_auto() -> None:
    c = cfg(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}, fp16={"enabled": "auto"})
    expect_error(lambda: zerorun.initialize(model=model(), config=c), "fp16.enabled")


def check_adam_means_adamw() -> None:
    e, opt, _, _ = zerorun.initialize(
        model=model(), config=cfg(optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    )
    assert type(opt) is torch.optim.AdamW, type(opt)
    e.destroy()
    c = cfg(optimizer={"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": False}})
    e, opt, _, _ = zerorun.initialize(model=model(), config=c)
    assert type(opt) is torch.optim.Adam, type(opt)
    e.destroy()


def check_user_optimizer_groups_match_plain_pytorch() -> None:
    m, ref = model(), model()

    def groups(mod: nn.Module) -> list[dict]:
        decay = [p for n, p in mod.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in mod.named_parameters() if n.endswith("bias")]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.05}]

    opt = torch.optim.AdamW(groups(m), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    engine, got_opt, _, got_sched = zerorun.initialize(
        model=m, optimizer=opt, lr_scheduler=sched, config=cfg()
    )
    assert got_opt is opt and got_sched is sched
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    ref_opt = torch.optim.AdamW(groups(ref), lr=0.02)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    losses = train(engine, 5)
    ref_losses = []
    for s in range(5):
        x, y = data(s)
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        ref_losses.append(loss.item())
    assert all(abs(a - b) <= 1e-5 * abs(b) + 1e-7 for a, b in zip(losses, ref_losses, strict=True)), (
        losses,
        ref_losses,
    )
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
    assert engine.get_lr() == [g["lr"] for g in ref_opt.param_groups]
    engine.destroy()


def check_callable_scheduler_and_config_scheduler() -> None:
    c = cfg(optimizer={"type": "SGD", "params": {"lr": 0.5}})
    engine, opt, _, sched = zerorun.initialize(
        model=model(),
        config=c,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)),
    )
    train(engine, 3)
    assert engine.get_lr() == [0.5 / 4], engine.get_lr()
    engine.destroy()
    c = cfg(
        optimizer={"type": "SGD", "params": {"lr": 0.5}},
        scheduler={
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": "auto",
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        },
    )
    engine, opt, _, sched = zerorun.initialize(model=model(), config=c)
    seen = []
    for _ in range(5):
        seen.append(engine.get_lr()[0])
        train(engine, 1)
    assert seen == [0.0, 0.0, 0.125, 0.25, 0.375], seen
    engine.destroy()


def check_optimizer_of_another_model() -> None:
    m = model()
    opt = torch.optim.AdamW(model().parameters(), lr=0.1)
    expect_error(
        lambda: zerorun.initialize(model=m, optimizer=opt, config=cfg()), "not parameters of `model`"
    )


def check_scheduler_bound_elsewhere() -> None:
    m = model()
    other = torch.optim.SGD(model().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, 1)
    c = cfg(optimizer={"type": "SGD", "params": {"lr": 0.5}})
    expect_error(
        lambda: zerorun.initialize(model=m, config=c, lr_scheduler=sched), "lr_scheduler", "lambda opt"
    )


def check_accumulation_survives_zero_grad() -> None:
    c = cfg(optimizer={"type": "AdamW", "params": {"lr": 0.01}}, gradient_accumulation_steps=2)
    a, b = model(), model()
    e1, *_ = zerorun.initialize(model=a, config=c)
    l1 = train(e1, 4)
    e1.destroy()
    e2, *_ = zerorun.initialize(model=b, config=c)
    l2 = train(e2, 4, zero_grad_each_micro=True)
    e2.destroy()
    assert l1 == l2 and e2.global_steps == 2 and e2.micro_steps == 4
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def check_training_data_loader() -> None:
    ds = torch.utils.data.TensorDataset(torch.randn(10, 5), torch.randn(10, 3))
    c = cfg(
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
        train_micro_batch_size_per_gpu="auto",
        train_batch_size=4,
    )
    engine, _, loader, _ = zerorun.initialize(model=model(), config=c, training_data=ds)
    assert (
        engine.train_micro_batch_size_per_gpu() == 4
        and engine.train_batch_size() == 4
        and loader.batch_size == 4
    )
    assert isinstance(loader.sampler, torch.utils.data.distributed.DistributedSampler)
    n = 0
    for x, y in loader:
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        n += 1
    assert n == 3 and engine.global_steps == 3
    engine.destroy()


def check_model_parameters_groups() -> None:
    m = model()
    groups = [{"params": list(m[0].parameters()), "lr": 0.0}, {"params": list(m[2].parameters())}]
    before = [p.detach().clone() for p in m[0].parameters()]
    engine, opt, _, _ = zerorun.initialize(
        model=m, model_parameters=groups, config=cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}})
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.1]
    train(engine, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, m[0].parameters(), strict=True)), "lr 0 group moved"
    engine.destroy()


def check_param_outside_optimizer_is_left_alone() -> None:
    m = model()
    opt = torch.optim.SGD(m[2].parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zerorun.initialize(model=m, optimizer=opt, config=cfg())
    assert any("not in the optimizer" in str(w.message) for w in caught)
    before = m[0].weight.detach().clone()
    train(engine, 2)
    assert torch.equal(before, m[0].weight)
    engine.destroy()


def check_launcher_config_needs_no_yaml_or_typer() -> None:
    """A rank under the launcher reads its config from ZERORUN_CONFIG_JSON (Contract 2): neither
    the YAML reader nor the CLI framework loads in the rank (zerorun.initialize, a step)."""
    os.environ["ZERORUN_CONFIG_JSON"] = json.dumps(cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    try:
        engine, *_ = zerorun.initialize(model=model())
        train(engine, 1)
        engine.destroy()
    finally:
        del os.environ["ZERORUN_CONFIG_JSON"]
    loaded = [name for name in ("yaml", "typer", "click") if name in sys.modules]
    assert not loaded, f"a rank loaded {loaded}"


def check_memory_provider_registered() -> None:
    from zerorun.channel import events

    engine, *_ = zerorun.initialize(
        model=model(), config=cfg(optimizer={"type": "AdamW", "params": {"lr": 0.1}})
    )
    train(engine, 1)
    provider = events.memory_provider()
    assert provider is not None
    summary = provider()
    (dev,) = summary
    assert set(summary[dev]) >= {"params", "grads", "master", "optimizer_states", "buffers", "total"}
    assert summary[dev]["optimizer_states"] > 0
    engine.destroy()


def check_stage_out_of_range() -> None:
    c = cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}})
    c["zero_optimization"] = {"stage": 7}
    try:
        zerorun.initialize(model=model(), config=c)
    except Exception as exc:  # noqa: BLE001 - the config layer or the runtime may refuse it
        assert "stage" in str(exc), exc
        assert isinstance(exc, (RuntimeConfigError,)) or type(exc).__name__ == "ConfigError", type(exc)
        return
    raise AssertionError("stage 7 accepted")


def check_backward_twice_without_step() -> None:
    engine, *_ = zerorun.initialize(
        model=model(), config=cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}})
    )
    x, y = data(0)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    expect_error(lambda: engine.backward(nn.functional.mse_loss(engine(x), y)), "engine.step()")
    engine.step()
    engine.backward(nn.functional.mse_loss(engine(x), y))  # fine again after step
    engine.step()
    engine.destroy()


def check_plain_loss_backward_then_step() -> None:
    """A script that calls loss.backward() itself (no accumulation) trains the same."""
    a, b = model(), model()
    c = cfg(optimizer={"type": "AdamW", "params": {"lr": 0.01}})
    e1, *_ = zerorun.initialize(model=a, config=c)
    train(e1, 3)
    e1.destroy()
    e2, *_ = zerorun.initialize(model=b, config=c)
    for s in range(3):
        x, y = data(s)
        nn.functional.mse_loss(e2(x), y).backward()
        e2.step()
    e2.destroy()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def check_activation_checkpointing() -> None:
    """torch.utils.checkpoint (reentrant and not) inside the model: same training as plain PyTorch."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)
            self.reentrant = reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
            return self.c(h)

    for reentrant in (False, True):
        m, ref = Ckpt(reentrant), Ckpt(reentrant)
        c = cfg(optimizer={"type": "AdamW", "params": {"lr": 0.01}}, gradient_accumulation_steps=2)
        engine, *_ = zerorun.initialize(model=m, config=c)
        train(engine, 4)
        engine.destroy()
        opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        for s in range(4):
            x, y = data(s)
            (nn.functional.mse_loss(ref(x.requires_grad_(reentrant)), y) / 2).backward()
            if s % 2 == 1:
                opt.step()
                opt.zero_grad()
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (reentrant, (p - q).abs().max())


def check_delayed_update_warmup_continues_after_resume() -> None:
    # Warm-up 3: steps 0-2 exact, then delayed. Saved after 2 steps, the resumed engine takes one
    # more exact step before its first delayed one -- not three again.
    import tempfile

    c = cfg(
        optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
        zero_optimization={"stage": 2, "reduce_bucket_size": 16, "offload_optimizer": {"device": "cpu"}},
        zerorun={"delayed_param_update": True, "delayed_param_update_warmup": 3},
    )
    with tempfile.TemporaryDirectory() as d:
        first, *_ = zerorun.initialize(model=model(), config=c)
        train(first, 2)
        first.save_checkpoint(d)
        first.destroy()
        resumed, *_ = zerorun.initialize(model=model(), config=c)
        resumed.load_checkpoint(d)
        placement = resumed.stage.state.placement
        assert placement.steps == 2, placement.steps
        train(resumed, 1)
        assert placement.delayed_steps == 0, placement.delayed_steps
        train(resumed, 1)
        assert placement.delayed_steps == 1, placement.delayed_steps
        resumed.destroy()


def check_offload_cpu_step_failure_raises_instead_of_hanging() -> None:
    # Stage 3 parameter offload with the step started in the backward: a buffer's host
    # write-back is left to the next forward's fetch (HostPlacement.settle). When its CPU update
    # raises -- during the backward, or after it -- the fetch raises that error; it used to wait
    # for good for a write-back that never came (the rank hung, and the job with it).
    import threading
    import time

    c = cfg(
        optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
        zero_optimization={
            "stage": 3,
            "reduce_bucket_size": 16,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    )
    for late in (False, True):
        engine, *_ = zerorun.initialize(model=model(), config=c)
        placement = engine.stage.state.placement
        train(engine, 2)
        assert placement._deferred, "no deferred write-back: the case is not exercised"
        update = placement._update

        def failing(job, *, push, indices=None, placement=placement, update=update, late=late):  # noqa: ANN001, ANN202
            if indices is not None and placement._deferrable(indices[0]):
                while late and placement._early is not None:  # after the backward ended
                    time.sleep(0.001)
                raise RuntimeError("injected CPU step failure")
            return update(job, push=push, indices=indices)

        placement._update = failing
        got: list[str] = []

        def two_steps(engine=engine, got=got) -> None:  # noqa: ANN001
            try:
                train(engine, 2)
                got.append("no error")
            except RuntimeError as e:
                got.append(str(e))

        runner = threading.Thread(target=two_steps, daemon=True)
        runner.start()
        runner.join(60)
        assert got == ["injected CPU step failure"], (late, got or "hung")
        engine.destroy()


CHECKS = [v for k, v in sorted(globals().items()) if k.startswith("check_")]


def main() -> None:
    # A process group the script made itself must be reused, not re-created.
    dist.init_process_group("gloo")
    results = {}
    for check in CHECKS:
        try:
            check()
            results[check.__name__] = "ok"
        except Exception:  # noqa: BLE001
            results[check.__name__] = "FAIL: " + traceback.format_exc()[-3000:]
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Which of the peer suites' gates are lifted on CPU, which are kept, and which tests are
deselected -- each with its reason. zerorun_peer_plugin.py applies LIFTED and DESELECTED."""

from __future__ import annotations

# "0" in the ranks' environment: run on a GPU as the suites are (run.py --device cuda): no gate
# lifted, no probe answered; the stand-ins and DESELECTED still apply (no network there either).
LIFT_ENV = "ZERORUN_PEER_LIFT"

# Decorators replaced by the identity before the test modules import them.
LIFTED: dict[str, dict[str, str]] = {
    "transformers": {
        "require_torch_accelerator": (
            "one accelerator: these tests train in-process on one device; on CPU the same code path runs "
            "(the layer, zerorun's runtime, gloo), as on one GPU"
        ),
    },
    "accelerate": {
        "require_non_cpu": (
            "a GPU: these tests prepare and train in-process on one device; the CPU runs the same layer and runtime"
        ),
    },
}

# Hardware probes answered for the CPU rank (module, name, reason): bf16 runs on CPU ranks.
PROBES: dict[str, tuple[str, str]] = {
    "transformers.training_args.is_torch_bf16_gpu_available": (
        "True",
        "TrainingArguments(bf16=True) asks for a bf16-capable GPU unless use_cpu, and use_cpu turns the DeepSpeed "
        "path off; zerorun trains in bf16 on CPU ranks, so the bf16 tests are meaningful there",
    ),
}

# Gates left in place.
KEPT: dict[str, str] = {
    "transformers require_torch_multi_accelerator / accelerate require_multi_device": (
        "several devices: the tests spawn torchrun/accelerate launch with one process per device; not "
        "meaningful with one CPU process"
    ),
    "slow (RUN_SLOW unset)": "the suites' slow classes are the multi-device ones above and the model zoo (hub models, GPUs)",
    "require_optuna": "optuna is not installed (hyperparameter search is not zerorun's subject)",
    "require_fp16 / require_deepspeed / require_huggingface_suite / require_deepspeed_aio": (
        "not lifted: they probe what is there (the layer answers them)"
    ),
}

# Tests deselected before they run (nodeid substring -> reason).
DESELECTED: dict[str, str] = {
    "test_deepspeed.py::DeepSpeedConfigIntegration::test_basic_run": (
        "spawns `accelerate launch` on accelerate's test_performance.py, which downloads the GLUE/MRPC dataset and "
        "distilbert-base-uncased's tokenizer (network)"
    ),
}


# Tests that run and fail, by suite ("Class::test" -> reason); run.py fails on any other failure.
KNOWN_FAILING: dict[str, dict[str, str]] = {
    "transformers": {
        "TestNonTrainerIntegrationDeepSpeed::test_arange_bf16": (
            "the test reads model.h[0].attn.embed_positions, which the installed transformers keeps in GPTJ's "
            "separate rotary-embedding module (AttributeError: 'GPTJAttention' object has no attribute "
            "'embed_positions'): test file and library disagree; it fails the same way with DeepSpeed"
        ),
    },
    "accelerate": {},
}


def deselected_reason(nodeid: str) -> str | None:
    for pattern, reason in DESELECTED.items():
        if pattern in nodeid:
            return reason
    return None

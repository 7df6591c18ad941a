"""ZeRO stage 3 against plain single-process PyTorch, on real gloo ranks (world 1, 2, 4).

One launch per world size runs every case (_s3_worker.py): the equivalence matrix (fp32/bf16 x
accumulation 1/4 x clipping on/off) on S3Net -- >= 3 partitioned groups, tied weights inside
the root group and across two block groups, a block called twice, a branch swapping two
blocks between steps, activation checkpointing, a frozen and an unused layer, an eval forward
after every step -- plus, at world 2 and 4: a zero.Init-built and a load_state_dict-loaded
model in the same matrix, zero.Init == normal construction, GatheredParameters read/modify,
safetensors loading slice by slice, the prefetch/live limits, and the cross-rank order check.

Tolerances are the stage 0-2 matrix's (test_equivalence.py): fp32 relative 1e-5 (+1e-6
absolute); bf16: fp32 quantities x10, 16-bit values one bf16 ulp (2^-7) of the largest value.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ._spawn import results_per_world

HERE = Path(__file__).resolve().parent
# ZR_S3_WORLDS narrows the launches (scripts/gpu_checks.sh: world 1 on NCCL, 2 and 4 on gloo).
WORLDS = tuple(int(w) for w in os.environ.get("ZR_S3_WORLDS", "1,2,4").split(","))
MULTI = [w for w in WORLDS if w > 1]
CASES = [f"{d}-ga{a}-clip{c}" for d in ("fp32", "bf16") for a in (1, 4) for c in ("0", "0.05")]
BUILDS = ["build-init", "build-load", "build-reentrant"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return results_per_world(tmp_path_factory, HERE / "_s3_worker.py", prefix="s3w", deadline_s=300)


def _check_equivalence(r: dict, world: int, name: str) -> None:
    fp32 = name.startswith("fp32")
    ranks = r["ranks"]
    steps = len(r["ref_losses"])
    for x in ranks:
        assert x["n_partitioned"] >= 3, x["group_names"]
        assert x["tied_kept"], "tied weights were untied"
        assert x["root_has_tied_block_weight"], "a weight tied across two groups must live in the root group"
        if world > 1:
            assert x["prefetches"] >= steps and x["prefetch_hits"] >= steps, "prefetch never happened"
            assert x["launched_during_backward"] >= steps * 3, (
                "gradients were not reduce-scattered during backward"
            )
    assert r["frozen_equal"], "the frozen layer changed"
    rtol = 1e-5 if fp32 else 2.0**-7
    accum = len(ranks[0]["losses"]) // steps
    for rank, x in enumerate(ranks):
        for i, got in enumerate(x["losses"]):
            ref = r["ref_losses"][i // accum][i % accum][rank]
            assert abs(got - ref) <= rtol * abs(ref) + 1e-6, f"rank {rank} loss #{i}: {got} vs {ref}"
        for i, (got, ref) in enumerate(zip(x["evals"], r["ref_evals"], strict=True)):
            assert abs(got - ref) <= rtol * abs(ref) + 1e-6, (
                f"rank {rank} eval loss after step {i}: {got} vs {ref}"
            )
    for step, (a, b) in enumerate(zip(ranks[0]["norms"], r["ref_norms"], strict=True)):
        assert abs(a - b) <= 1e-5 * b + 1e-7, f"step {step}: grad norm {a} vs reference {b}"
    for n, (err, scale) in r["master_err"].items():
        assert err <= (1e-5 if fp32 else 1e-4) * scale + 1e-6, f"master {n}: error {err} (max |w| {scale})"
    for n, (err, scale) in r["compute_err"].items():
        assert err <= (1e-5 if fp32 else 2.0**-7) * scale + 1e-6, f"param {n} (state_dict): error {err}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", CASES)
def test_matches_reference(results, world: int, name: str) -> None:  # noqa: ANN001
    _check_equivalence(results(world)[name], world, name)


@pytest.mark.parametrize("world", MULTI)
@pytest.mark.parametrize("name", BUILDS)
def test_init_built_and_loaded_models_match_reference(results, world: int, name: str) -> None:  # noqa: ANN001
    _check_equivalence(results(world)[name], world, "bf16")


def _check_estimate(name: str, x: dict, mem: dict, world: int) -> None:
    """zerorun.estimate (Contract 4) for the same Ψ: master, Adam states and gradient slices
    (after the backward) are Ψ/N each up to the shards' padding; in mixed precision no 16-bit
    slice beside the master (the estimate's params 0; what the ledger shows there is the
    persistent and frozen parameters the estimate leaves out); in fp32 no master."""
    from zerorun.estimate import model_state_bytes

    fp32 = name.startswith("fp32")
    psi = x["partitioned_numel"] + x["persistent_bytes"] // (4 if fp32 else 2)
    config = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3}, "bf16": {"enabled": not fp32}}
    config["gradient_accumulation_steps"] = int(name.split("-ga")[1].split("-")[0])
    est = model_state_bytes(psi, world, config).terms["gpu"]
    pad = x["grad_shard_bytes"] // 4 - psi / world  # padding elements per rank (shards are equal)
    measured = {"grads": x["grads_after_backward"], "master": mem["master"], "optimizer_states": mem["optimizer_states"]}
    for term, width in (("grads", 4), ("master", 0 if fp32 else 4), ("optimizer_states", 8)):
        assert est[term] - width <= measured[term] <= est[term] + width * pad + width, (name, term, measured, est)
    if not fp32:
        assert est["params"] == 0
    # (scripts/gpu_checks.sh runs world 1 with the collectives forced: staged as several ranks do)
    forced = world == 1 and os.environ.get("ZERORUN_DEBUG_COLLECTIVES") == "1"
    _check_estimated_buffers(x, mem, world, config, psi, debug_collectives=forced)


def _check_estimated_buffers(x: dict, mem: dict, world: int, config: dict, psi: int, *, debug_collectives: bool = False) -> None:
    """The estimate's stage-3 buffers with G = the largest group bound the runtime's ledger
    (peak gathered + peak staging, engine.memory_summary()'s buffers) term by term. One rank
    with ZERORUN_DEBUG_COLLECTIVES=1 (not in the config) stages one group in place, as several
    ranks do."""
    from zerorun.estimate import model_state_bytes

    bufs = model_state_bytes(psi, world, config, largest_layer=x["max_group_numel"]).buffers["gpu"]
    if debug_collectives:  # (the estimate's one-rank staging is the accumulation's temporary)
        bufs = {**bufs, "reduce_staging": max(bufs.get("reduce_staging", 0.0), x["max_group_numel"] * 4.0)}
    esize = 4 if not config.get("bf16", {}).get("enabled") else 2
    assert x["peak_live_numel"] * esize <= bufs["gathered_params"], (x["peak_live_numel"], bufs)
    assert x["peak_staging_bytes"] <= bufs.get("reduce_staging", 0.0), (x["peak_staging_bytes"], bufs)
    assert mem["buffers"] <= bufs["gathered_params"] + bufs.get("reduce_staging", 0.0), (mem, bufs)
    if world == 1:  # exact at one rank: nothing (fp32: the shard is the parameter) or root + one group
        assert bufs["gathered_params"] == (0 if esize == 4 else 2 * x["max_group_numel"] * esize), bufs
        assert bufs["gathered_params"] < psi * esize


@pytest.mark.parametrize("world", WORLDS)
def test_memory_at_rest(results, world: int) -> None:  # noqa: ANN001
    """Per-rank parameter state at rest = partitioned total / N + persistent (+ frozen layers,
    which stay replicated); gradient bytes = this rank's shards after the backward, none after
    the step (no gradient memory while the next forward builds its activations)."""
    for name in CASES:
        for x in results(world)[name]["ranks"]:
            assert x["at_rest_numel"] * world == x["partitioned_numel"]
            # Shards and masters on the device: the fp32 master shard is the at-rest parameter
            # (16 bytes per parameter / N with Adam, not 18).
            assert x["rest_is_master"]
            mem = next(iter(x["memory"].values()))
            if name.startswith("fp32"):  # fp32 training keeps no separate master
                assert mem["params"] == x["at_rest_bytes"] + x["persistent_bytes"] + x["frozen_bytes"], (
                    name,
                    mem,
                )
                assert mem["master"] == 0
            else:
                assert mem["params"] == x["persistent_bytes"] + x["frozen_bytes"], (name, mem)
                assert (
                    mem["master"]
                    == x["master_bytes_total"]
                    == x["at_rest_bytes"] + x["persistent_bytes"] * 2 // world
                )
            # gradient slices exist from the step's first reduction to the optimizer step only
            assert x["grads_after_backward"] == x["grad_shard_bytes"], (name, x["grads_after_backward"])
            assert mem["grads"] == 0, (name, mem)
            _check_estimate(name, x, mem, world)
            if world > 1:
                assert mem["buffers"] > 0, "gathered parameters / staging not accounted"
                # one group's reduce-scatter staging alive at a time (FSDP2 keeps one input buffer)
                assert 0 < x["peak_staging_bytes"] <= x["max_group_staging_bytes"], (name, x["peak_staging_bytes"])


@pytest.mark.parametrize("world", MULTI)
def test_live_and_prefetch_limits(results, world: int) -> None:  # noqa: ANN001
    for x in results(world)["limits"]:
        tight = x["tight"]
        assert tight["prefetches"] > 0
        assert tight["peak_live_numel"] <= tight["max_live"] + tight["max_group_numel"]
        assert x["no_prefetch"]["prefetches"] == 0
        assert x["no_prefetch"]["peak_live_numel"] <= tight["peak_live_numel"]
        assert x["keep"]["peak_live_numel"] > tight["peak_live_numel"], "reuse distance kept nothing"
        assert x["by_class"]["n_partitioned"] > tight["n_partitioned"]
        # the estimate's gathered-parameter bound for each launch's keys (fp32, reuse distance 0
        # unless set), below the whole model where the keys bound it
        from zerorun.estimate import model_state_bytes

        for label, zero, zr in (
            ("tight", {"stage3_max_live_parameters": 2000, "stage3_prefetch_bucket_size": 400}, {}),
            ("no_prefetch", {"stage3_prefetch_bucket_size": 0}, {}),
            ("keep", {"stage3_max_reuse_distance": 1_000_000_000}, {}),
            ("no_reshard", {}, {"stage3_reshard_after_forward": False}),
        ):
            y = x[label]
            cfg = {"optimizer": {"type": "AdamW"}, "zerorun": zr}
            cfg["zero_optimization"] = {"stage": 3, "stage3_max_reuse_distance": 0, **zero}
            psi = y["partitioned_numel"]
            bufs = model_state_bytes(psi, world, cfg, largest_layer=y["max_group_numel"]).buffers["gpu"]
            assert y["peak_live_numel"] * 4 <= bufs["gathered_params"], (label, y["peak_live_numel"], bufs)
            assert y["peak_staging_bytes"] <= bufs["reduce_staging"] == y["max_group_numel"] * 4, (label, bufs)
            if label in ("tight", "no_prefetch"):
                assert bufs["gathered_params"] < psi * 4, (label, bufs, psi)
        for label in ("no_prefetch", "keep", "no_reshard"):  # same layouts: bit-identical
            assert x[label]["losses"] == tight["losses"], f"{label} changed the math"
        for a, b in zip(x["by_class"]["losses"], tight["losses"], strict=True):  # other layouts: fp32 order
            assert abs(a - b) <= 1e-5 * abs(b) + 1e-6


@pytest.mark.parametrize("world", MULTI)
def test_zero_init_equals_normal_construction(results, world: int) -> None:  # noqa: ANN001
    for x in results(world)["init_equal"]:
        assert x["placeholders"] and x["same"] and x["shapes_ok"] and x["gpt_same"]
        assert x["host_ok"] and x["module_same"] and x["stage2_same"]
        assert x["shard_numel"] * world < x["total"] + 64 * world  # ~ total / N (+ per-parameter padding)


@pytest.mark.parametrize("world", MULTI)
def test_gathered_parameters(results, world: int) -> None:  # noqa: ANN001
    for x in results(world)["gathered"]:
        assert x["released_shape"] == [0]
        assert (
            x["read_ok"] and x["discarded"] and x["modified"] and x["master_ok"] and x["other_master_exact"]
        ), x
        assert x["init_modified"], "GatheredParameters(modifier_rank=0) on a zero.Init model"
        assert x["inside_forward_ok"]
        assert x["errors"] == [True, True], "load_state_dict / load_pretrained mistakes need clear messages"


@pytest.mark.parametrize("world", MULTI)
def test_safetensors_loaded_slice_by_slice(results, world: int) -> None:  # noqa: ANN001
    for x in results(world)["safetensors"]:
        assert x["missing"] == []
        assert x["master_err"] <= 1e-6
        for a, b in zip(x["losses"], x["ref_losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b) + 1e-6


@pytest.mark.parametrize("world", MULTI)
def test_order_check_names_modules(results, world: int) -> None:  # noqa: ANN001
    for x in results(world)["order_check"]:
        assert x["raised"], "divergent ranks were not detected"
        assert "blocks.2" in x["message"] and "blocks.3" in x["message"]


@pytest.mark.parametrize("world", MULTI)
def test_fp16_overflow_on_one_rank_skips_everywhere(results, world: int) -> None:  # noqa: ANN001
    xs = results(world)["fp16_overflow"]
    for x in xs:
        assert x["skipped"] == 1
        before, after = x["sums"][1]
        assert before == after, "parameters changed on the skipped step"
        assert x["sums"][0][0] != x["sums"][0][1] and x["sums"][2][0] != x["sums"][2][1]
        assert x["scales"] == [1024.0, 512.0, 512.0]  # hysteresis 1: halved at once

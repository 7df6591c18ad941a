"""The batch triad (DeepSpeed's rule), as a pure function."""

from __future__ import annotations

import pytest

from zerorun.config import OPEN_NOTE, load_config, resolve_batch
from zerorun.errors import ConfigError

T, M, A = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@pytest.mark.parametrize(
    "train,micro,accum,world,expected,derived",
    [
        (32, 4, 2, 4, (32, 4, 2), ()),
        (32, 4, None, 2, (32, 4, 4), (A,)),
        (32, None, 2, 4, (32, 4, 2), (M,)),
        (None, 4, 2, 8, (64, 4, 2), (T,)),
        (32, None, None, 8, (32, 4, 1), (A, M)),
        (None, 4, None, 3, (12, 4, 1), (A, T)),
        # an `auto` the other two determine is resolved from the world size
        ("auto", 4, 2, 2, (16, 4, 2), (T,)),
        (32, "auto", 2, 4, (32, 4, 2), (M,)),
        (32, 4, "auto", 2, (32, 4, 4), (A,)),
    ],
)
def test_resolves_like_deepspeed(train, micro, accum, world, expected, derived):
    r = resolve_batch(train, micro, accum, world)
    assert (r.train_batch_size, r.train_micro_batch_size_per_gpu, r.gradient_accumulation_steps) == expected
    assert set(r.derived) == set(derived)
    assert r.open == () and r.complete
    assert r.lines  # the arithmetic is shown


@pytest.mark.parametrize(
    "train,micro,accum,world,open_",
    [
        ("auto", "auto", "auto", 4, (T, M, A)),  # Hugging Face's template
        (None, 4, "auto", 4, (T, A)),
        (32, "auto", None, 4, (M, A)),
        ("auto", None, "auto", 2, (T, M, A)),
        (None, None, None, 4, (T, M, A)),  # nothing: the script must pass a batch size
        (None, None, 4, 2, (T, M)),
        (None, 4, 2, None, (T,)),  # world size not known yet
        (32, 4, None, None, (A,)),
    ],
)
def test_open_values_are_left_open_never_defaulted(train, micro, accum, world, open_):
    r = resolve_batch(train, micro, accum, world)
    assert set(r.open) == set(open_)
    assert not r.complete
    for name in r.open:
        assert getattr(r, name) is None or name == A and accum not in (None, "auto")
    if "auto" in (train, micro, accum) and (train, micro, accum).count("auto") + (train, micro, accum).count(None) > 1:
        assert OPEN_NOTE in " ".join(r.lines)


@pytest.mark.parametrize(
    "train,micro,accum,world,expected",
    [
        (32, 4, 2, 3, "train_batch_size 32 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 × world size 3 = 24"),
        (30, 4, None, 2, "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 × world size 2 = 8"),
        (30, None, 2, 4, "not divisible by gradient_accumulation_steps 2 × world size 4 = 8"),
        (30, None, None, 8, "train_batch_size 30 is not divisible by world size 8 = 8"),
        (4, 8, None, 1, "not divisible"),
        (30, 4, 2, None, "train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 = 8"),
        (8, 4, 1, 0, "world size must be at least 1"),
    ],
)
def test_mismatch_shows_the_arithmetic(train, micro, accum, world, expected):
    with pytest.raises(ConfigError) as info:
        resolve_batch(train, micro, accum, world)
    assert expected in str(info.value)


def test_load_config_checks_the_triad_for_a_world_size(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"train_batch_size": 32,\n "train_micro_batch_size_per_gpu": 4,\n "gradient_accumulation_steps": 2}')
    assert load_config(p, world_size=4).batch.complete
    assert load_config(p).batch is None  # no world size: nothing resolved
    with pytest.raises(ConfigError, match=rf"{p}: batch sizes disagree"):
        load_config(p, world_size=2)
    # no batch size at all is not a load error: the script may pass one
    assert load_config({}, world_size=2).batch.open == (T, M, A)


@pytest.mark.parametrize(
    "given,worlds,expected,words",
    [
        # train_batch_size kept when it divides: the accumulation grows
        ((12, 2, None), (3, 2), (12, 2, 3), "train_batch_size 12 kept = micro 2 × accum 3 × 2 ranks; gradient_accumulation_steps 2 -> 3"),
        ((12, 2, 2), (3, 2), (12, 2, 3), "train_batch_size 12 kept"),  # all three given
        ((32, None, 2), (4, 2), (32, 4, 4), "train_batch_size 32 kept"),  # the micro batch stays what it was
        ((None, 4, None), (4, 2), (16, 4, 2), "train_batch_size 16 kept"),  # a derived global batch is kept too
        # else it changes, and the message says to what
        ((6, 2, None), (3, 2), (4, 2, 1), "train_batch_size 6 is not a multiple of micro 2 × 2 ranks = 4, so it changes: train_batch_size 6 -> 4"),
        ((6, 2, 1), (3, 2), (4, 2, 1), "6 -> 4 = micro 2 × accum 1 × 2 ranks (was micro 2 × accum 1 × 3 ranks)"),
    ],
)  # fmt: skip
def test_rebatch_for_another_world_size(given, worlds, expected, words):
    from zerorun.config.batch import rebatch

    r = rebatch(*given, from_world=worlds[0], to_world=worlds[1])
    assert r is not None and r.world_size == worlds[1]
    assert (r.train_batch_size, r.train_micro_batch_size_per_gpu, r.gradient_accumulation_steps) == expected
    assert words in r.message
    assert r.train_batch_size == r.train_micro_batch_size_per_gpu * r.gradient_accumulation_steps * worlds[1]
    assert resolve_batch(*r.values().values(), worlds[1]).complete


def test_rebatch_leaves_alone_what_the_script_or_integration_decides():
    from zerorun.config.batch import rebatch

    assert rebatch(6, 2, None, from_world=3, to_world=3) is None  # same world
    assert rebatch("auto", 2, 1, from_world=3, to_world=2) is None  # HF Trainer fills `auto`
    assert rebatch(None, None, None, from_world=3, to_world=2) is None  # the script passes a batch size

"""Script inspection: the config file among the script's arguments, a declared --local_rank."""

from __future__ import annotations

from pathlib import Path

from _plans import plan_for

from zerorun.launch.target import find_config_argument


def test_find_config_argument(tmp_path: Path) -> None:
    assert find_config_argument(["--deepspeed", "ds.json"]) == ("--deepspeed", "ds.json")
    assert find_config_argument(["--deepspeed_config=c.yaml", "--config", "o.json"]) == ("--deepspeed_config", "c.yaml")
    # DeepSpeed's own --deepspeed switch, with the file elsewhere
    assert find_config_argument(["--deepspeed", "--deepspeed_config", "ds.json"]) == ("--deepspeed_config", "ds.json")
    assert find_config_argument(["--deepspeed", "--lr", "1"]) is None
    assert find_config_argument(["--config", "model_small"]) is None  # not a config file
    existing = tmp_path / "settings"
    existing.write_text("{}")
    assert find_config_argument(["--config", str(existing)]) == ("--config", str(existing))
    assert find_config_argument(["--", "--config", "a.json"]) is None


def test_declared_local_rank_arg() -> None:
    from zerorun.launch.target import declared_local_rank_arg

    assert declared_local_rank_arg("p.add_argument('--local_rank', type=int, default=-1)") == "--local_rank"
    assert declared_local_rank_arg('parser.add_argument(\n    "--local-rank", type=int)') == "--local-rank"
    assert declared_local_rank_arg("p.add_argument('-l', '--local_rank', type=int)") == "--local_rank"
    assert declared_local_rank_arg("rank = int(os.environ['LOCAL_RANK'])  # --local_rank") is None
    plan = plan_for()
    from dataclasses import replace

    assert replace(plan, local_rank_arg="--local_rank").rank_argv(plan.ranks[1], "py")[-1] == "--local_rank=1"
    assert plan.rank_argv(plan.ranks[1], "py") == plan.target.shim_argv("py")

"""Environment propagation layers, plan-variable protection, secrets and redaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerorun.errors import ConfigError
from zerorun.launch.environment import (
    REDACTED,
    build_env_spec,
    env_files,
    is_secret,
    parse_assignments,
    read_env_file,
    redact_env,
    scrub,
)

LAUNCHER_ENV = {
    "NCCL_DEBUG": "INFO",
    "NCCL_IB_HCA": "mlx5",
    "PYTHONPATH": "/src",
    "CUDA_LAUNCH_BLOCKING": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "GLOO_SOCKET_IFNAME": "eth0",
    "UCX_TLS": "rc",
    "FI_PROVIDER": "efa",
    "HOME": "/root",
    "PATH": "/usr/bin",
    "HF_TOKEN": "hf_abcdefgh",
    "NCCL_SECRET_THING": "s3cr3t-value",
    "RANK": "7",
    "MASTER_ADDR": "launcher-box",
    "CUDA_VISIBLE_DEVICES": "3",
    "ZERORUN_RUN_ID": "old",
}


def spec(tmp_path: Path, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("environ", LAUNCHER_ENV)
    kw.setdefault("cwd", tmp_path / "cwd")
    kw.setdefault("home", tmp_path / "home")
    (tmp_path / "cwd").mkdir(exist_ok=True)
    (tmp_path / "home").mkdir(exist_ok=True)
    return build_env_spec(**kw)


def test_prefixes_travel_plan_and_secrets_do_not(tmp_path: Path) -> None:
    s = spec(tmp_path)
    env = s.for_host("node1")
    assert env == {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "PYTHONPATH": "/src",
        "CUDA_LAUNCH_BLOCKING": "1",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "GLOO_SOCKET_IFNAME": "eth0",
        "UCX_TLS": "rc",
        "FI_PROVIDER": "efa",
    }
    assert s.withheld == ("NCCL_SECRET_THING",)
    # A local node inherits the launcher's environment itself: only explicit layers are added.
    assert s.for_host("localhost", remote=False) == {}


def test_layers_and_precedence(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    (tmp_path / "home" / ".deepspeed_env").write_text("A=home-ds\nB=home-ds\nC=home-ds\nD=home-ds\n")
    (tmp_path / "home" / ".zerorun_env").write_text("B=home-zr\n")
    (tmp_path / "cwd" / ".deepspeed_env").write_text("C=cwd-ds\nNCCL_DEBUG=WARN\n")
    (tmp_path / "cwd" / ".zerorun_env").write_text("D=cwd-zr\nE=file\nF=file\n")
    s = spec(
        tmp_path,
        config_env={"E": "config", "F": "config", "G": 3, "H": True},
        cli_env=["F=cli", "HF_TOKEN"],
        config_host_env={"node2": {"GLOO_SOCKET_IFNAME": "veth-cfg", "E": "host-cfg"}},
        hostfile_env={"node2": {"GLOO_SOCKET_IFNAME": "veth-hf"}},
    )
    n1 = s.for_host("node1")
    assert [n1[k] for k in "ABCDEFGH"] == ["home-ds", "home-zr", "cwd-ds", "cwd-zr", "config", "cli", "3", "1"]
    assert n1["NCCL_DEBUG"] == "WARN"  # an env file beats the inherited value
    assert n1["HF_TOKEN"] == "hf_abcdefgh"  # named explicitly: travels
    assert n1["GLOO_SOCKET_IFNAME"] == "eth0"
    n2 = s.for_host("node2")
    assert n2["GLOO_SOCKET_IFNAME"] == "veth-hf" and n2["E"] == "host-cfg"
    assert s.sources["C"].endswith(".deepspeed_env:1") and s.sources["F"] == "--env"


def test_env_files_order_and_same_dir(tmp_path: Path) -> None:
    (tmp_path / ".zerorun_env").write_text("X=1\n")
    (tmp_path / ".deepspeed_env").write_text("X=0\n")
    assert env_files(cwd=tmp_path, home=tmp_path) == [tmp_path / ".deepspeed_env", tmp_path / ".zerorun_env"]


def test_env_file_syntax(tmp_path: Path) -> None:
    p = tmp_path / ".zerorun_env"
    p.write_text(
        "# comment\n\nexport A=1\nB = 'quoted value'  \nC=\"x\"\nD=a#b=c $HOME `id`\nE='unbalanced\nF=\n"
    )
    got = {k: v for k, (v, _) in read_env_file(p).items()}
    assert got == {"A": "1", "B": "quoted value", "C": "x", "D": "a#b=c $HOME `id`", "E": "'unbalanced", "F": ""}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("JUSTANAME\n", ":1: expected NAME=VALUE"),
        ("A=1\n1BAD=2\n", ":2: '1BAD' is not an environment variable name"),
        ("RANK=3\n", ":1: RANK is set by the launcher"),
        ("CUDA_VISIBLE_DEVICES=0,1\n", "--include HOST:0,1"),
    ],
)
def test_bad_env_files(tmp_path: Path, text: str, fragment: str) -> None:
    p = tmp_path / ".deepspeed_env"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_env_file(p)
    assert fragment in str(err.value) and str(p) in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"cli_env": ["MASTER_PORT=1"]}, "--env 'MASTER_PORT=1': MASTER_PORT is set by the launcher"),
        ({"cli_env": ["ZERORUN_DEVICE=cpu"]}, "ZERORUN_DEVICE is set by the launcher"),
        ({"cli_env": ["NOT_THERE"]}, "NOT_THERE is not set in the launcher's environment"),
        ({"cli_env": ["A-B=1"]}, "'A-B' is not an environment variable name"),
        ({"config_env": {"RANK": 1}}, "config launcher.env.RANK: RANK is set by the launcher"),
        ({"config_env": {"X": [1, 2]}}, "config launcher.env.X must be a string or number"),
        ({"config_host_env": {"n": "eth0"}}, "launcher.host_env.n must be a mapping"),
        ({"config_host_env": {"n": {"WORLD_SIZE": 2}}}, "WORLD_SIZE is set by the launcher"),
    ],
)
def test_bad_explicit_env(tmp_path: Path, kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        spec(tmp_path, **kwargs)
    assert fragment in str(err.value)


def test_assignment_values_are_verbatim() -> None:
    assert parse_assignments(["A=x=y", "B=", "C=$(id);rm -rf / 'q'"], environ={}) == {
        "A": "x=y",
        "B": "",
        "C": "$(id);rm -rf / 'q'",
    }


def test_config_none_value_copies_from_launcher(tmp_path: Path) -> None:
    s = spec(tmp_path, config_env={"HF_TOKEN": None})
    assert s.for_host("x")["HF_TOKEN"] == "hf_abcdefgh"


def test_secret_detection_and_redaction() -> None:
    for name in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "api_key", "WANDB_API_KEY", "MY_PASSWD"):
        assert is_secret(name)
    for name in ("NCCL_DEBUG", "PYTHONPATH", "HOME", "MASTER_ADDR"):
        assert not is_secret(name)
    env = {"HF_TOKEN": "hf_abcdefgh", "NCCL_DEBUG": "INFO", "PIN": "1"}
    assert redact_env(env) == {"HF_TOKEN": REDACTED, "NCCL_DEBUG": "INFO", "PIN": "1"}
    assert env["HF_TOKEN"] == "hf_abcdefgh"  # a copy
    assert scrub("login with hf_abcdefgh now", env) == f"login with {REDACTED} now"
    assert scrub("x=1", {"SHORT_KEY": "1"}) == "x=1"

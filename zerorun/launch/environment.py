"""Which environment variables travel to the ranks, and hiding secrets in what zerorun prints.

A remote rank does not inherit the launcher's environment: it starts from the login
environment of its node. What it gets on top, lowest precedence first:

1. the launcher's own variables with a `TRAVEL_PREFIXES` prefix (NCCL_*, CUDA_*, PYTHON*, ...),
   minus anything that looks secret (those travel only when named explicitly, below);
2. env files, later overriding earlier: ~/.deepspeed_env, ~/.zerorun_env, ./.deepspeed_env,
   ./.zerorun_env (DeepSpeed reads `.deepspeed_env` from home and cwd, cwd winning);
3. the config's `launcher.env`;
4. `--env KEY=VAL` (or `--env KEY`: copy KEY from the launcher's environment);
5. per-host values: the config's `launcher.host_env[HOST]`, then `NAME=VALUE` on the
   host's hostfile line. Host-specific beats global: they exist for what differs per node
   (the network interface in NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME).

Variables the launch plan sets per node or rank (`PLAN_VARIABLES`, `ZERORUN_*`) never
travel from the launcher, and naming one explicitly is an error: a launcher's own `RANK` or
`CUDA_VISIBLE_DEVICES` leaking onto a remote node is a classic source of wrong jobs.
Local ranks inherit the launcher's whole environment anyway; the explicit and per-host layers
apply to them too. Values are passed verbatim: nothing here or downstream runs them
through a shell.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zerorun.errors import ConfigError

__all__ = [
    "TRAVEL_PREFIXES",
    "PLAN_VARIABLES",
    "ENV_FILE_NAMES",
    "REDACTED",
    "EnvSpec",
    "build_env_spec",
    "is_secret",
    "is_plan_variable",
    "redact_env",
    "scrub",
    "parse_assignments",
    "read_env_file",
    "env_files",
]

TRAVEL_PREFIXES: tuple[str, ...] = ("NCCL_", "PYTHON", "CUDA_", "TORCH_", "GLOO_", "UCX_", "FI_")

# Set by the launch plan for each node or rank (torchrun's contract + device selection).
PLAN_VARIABLES: frozenset[str] = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "NODE_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "TORCHELASTIC_RUN_ID",
    }
)
_PLAN_PREFIXES = ("ZERORUN_",)

# Read in this order, later files overriding earlier ones, home before cwd.
ENV_FILE_NAMES: tuple[str, ...] = (".deepspeed_env", ".zerorun_env")

REDACTED = "<redacted>"

_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Secret values shorter than this are not scrubbed from free text: replacing every "1" in a
# log line would hide more than it protects.
_MIN_SCRUB_LEN = 4


def is_secret(name: str) -> bool:
    """Names that look like credentials (`*TOKEN*`, `*SECRET*`, `*PASSWORD*`, `*KEY*`, ...)."""
    upper = name.upper()
    return any(word in upper for word in _SECRET_WORDS)


def is_plan_variable(name: str) -> bool:
    return name in PLAN_VARIABLES or name.startswith(_PLAN_PREFIXES)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy fit for printing: secret-looking values replaced by `REDACTED`."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def scrub(text: str, env: Mapping[str, str]) -> str:
    """Remove the values of secret-looking variables of `env` from free text (log lines, argv)."""
    for name, value in env.items():
        if is_secret(name) and len(value) >= _MIN_SCRUB_LEN:
            text = text.replace(value, REDACTED)
    return text


@dataclass(frozen=True)
class EnvSpec:
    """The environment layers of one job, resolved once; `for_host` gives one node's extras."""

    inherited: Mapping[str, str] = field(default_factory=dict)
    explicit: Mapping[str, str] = field(default_factory=dict)
    per_host: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Variables with a travelling prefix held back because they look secret (for a notice:
    # "name it with --env to send it").
    withheld: tuple[str, ...] = ()
    # variable -> where its value came from ("--env", "/home/u/.zerorun_env:3", ...).
    sources: Mapping[str, str] = field(default_factory=dict)

    def for_host(self, host: str, *, remote: bool = True) -> dict[str, str]:
        """What a rank on `host` gets on top of its node's own environment (and the plan's
        variables, which the caller sets last). A local node already inherits the launcher's
        environment, so it skips the inherited layer."""
        env: dict[str, str] = dict(self.inherited) if remote else {}
        env.update(self.explicit)
        env.update(self.per_host.get(host, {}))
        return env


def build_env_spec(
    *,
    environ: Mapping[str, str] | None = None,
    cli_env: Sequence[str] = (),
    config_env: Mapping[str, object] | None = None,
    config_host_env: Mapping[str, Mapping[str, object]] | None = None,
    hostfile_env: Mapping[str, Mapping[str, str]] | None = None,
    cwd: str | Path | None = None,
    home: str | Path | None = None,
    read_files: bool = True,
) -> EnvSpec:
    """Resolve every layer (see the module docstring); invalid input raises ConfigError."""
    environ = os.environ if environ is None else environ
    sources: dict[str, str] = {}

    inherited: dict[str, str] = {}
    withheld: list[str] = []
    for name, value in environ.items():
        if not name.startswith(TRAVEL_PREFIXES) or is_plan_variable(name):
            continue
        if is_secret(name):
            withheld.append(name)
            continue
        inherited[name] = value
        sources[name] = "launcher environment"

    explicit: dict[str, str] = {}
    if read_files:
        for path in env_files(cwd=cwd, home=home):
            for name, (value, where) in read_env_file(path).items():
                explicit[name] = value
                sources[name] = where
    for name, value in _config_mapping(config_env or {}, "launcher.env", environ).items():
        explicit[name] = value
        sources[name] = "config launcher.env"
    for name, value in parse_assignments(cli_env, source="--env", environ=environ).items():
        explicit[name] = value
        sources[name] = "--env"

    per_host: dict[str, dict[str, str]] = {}
    for host, mapping in (config_host_env or {}).items():
        if not isinstance(mapping, Mapping):
            raise ConfigError(
                f"config launcher.host_env.{host} must be a mapping of variable names to values "
                f"(got {type(mapping).__name__})."
            )
        per_host.setdefault(host, {}).update(
            _config_mapping(mapping, f"launcher.host_env.{host}", environ)
        )
    for host, mapping in (hostfile_env or {}).items():
        for name in mapping:
            _check_name(name, f"hostfile entry of {host}")
        per_host.setdefault(host, {}).update(mapping)

    return EnvSpec(
        inherited=inherited,
        explicit=explicit,
        per_host=per_host,
        withheld=tuple(sorted(w for w in withheld if w not in explicit)),
        sources=sources,
    )


def parse_assignments(
    items: Iterable[str], *, source: str = "--env", environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`KEY=VAL` (VAL verbatim, may contain '=') or `KEY` (copied from the launcher's env)."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        _check_name(name, f"{source} {item!r}")
        if not sep:
            if name not in environ:
                raise ConfigError(
                    f"{source} {name}: {name} is not set in the launcher's environment; "
                    f"give a value ({source} {name}=VALUE) or export it first."
                )
            value = environ[name]
        out[name] = value
    return out


def env_files(*, cwd: str | Path | None = None, home: str | Path | None = None) -> list[Path]:
    """The env files that exist, in the order they apply (later wins)."""
    cwd_path = Path.cwd() if cwd is None else Path(cwd)
    home_path = Path.home() if home is None else Path(home)
    dirs = [home_path] if home_path.resolve() == cwd_path.resolve() else [home_path, cwd_path]
    return [d / n for d in dirs for n in ENV_FILE_NAMES if (d / n).is_file()]


def read_env_file(path: str | Path) -> dict[str, tuple[str, str]]:
    """`KEY=VALUE` lines (DeepSpeed's .deepspeed_env): name -> (value, "file:line").

    `export KEY=VALUE` is accepted, `#` starts a comment only at the start of a line (values
    may contain '#'), whitespace around the value is dropped and then one pair of matching
    outer quotes (DeepSpeed's shell would have removed them; quote to keep spaces); nothing
    is expanded.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read env file {p}: {err}") from err
    out: dict[str, tuple[str, str]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{p}:{lineno}"
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(f"{where}: expected NAME=VALUE, got {raw.strip()!r}.")
        _check_name(name, where)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[name] = (value, where)
    return out


def _config_mapping(mapping: Mapping[str, object], key: str, environ: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in mapping.items():
        _check_name(str(name), f"config {key}.{name}")
        if value is None:  # `NAME:` with no value in YAML: take it from the launcher
            out[str(name)] = parse_assignments([str(name)], source=f"config {key}", environ=environ)[str(name)]
        elif isinstance(value, bool):
            out[str(name)] = "1" if value else "0"
        elif isinstance(value, (str, int, float)):
            out[str(name)] = str(value)
        else:
            raise ConfigError(
                f"config {key}.{name} must be a string or number (got {type(value).__name__}); "
                "quote it if it is a list or mapping meant as text."
            )
    return out


def _check_name(name: str, where: str) -> None:
    if not _ENV_NAME.match(name):
        raise ConfigError(
            f"{where}: {name!r} is not an environment variable name (letters, digits and '_', "
            "not starting with a digit)."
        )
    if is_plan_variable(name):
        hint = (
            "pick devices with --include HOST:0,1 or --num_gpus"
            if name == "CUDA_VISIBLE_DEVICES"
            else "use the launcher's options (--master_addr, --master_port, --hostfile, ...)"
        )
        raise ConfigError(f"{where}: {name} is set by the launcher for each node or rank; {hint}.")

"""`zerorun print-config CONFIG`: validate a config and show what zerorun will do with it.

Prints the resolved config (values that differ from DeepSpeed's defaults highlighted), the
batch arithmetic for the world size, every `auto` left open, warnings, notices and -- with
`--params` -- the memory estimate of the model states. Exit 0 when valid (warnings allowed),
1 on errors. `--json` prints the same as one JSON document.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from typer.core import TyperCommand

from zerorun.cli.errors import report_errors
from zerorun.errors import ZerorunError

__all__ = ["app", "BothSpellings", "world_size_from_options"]


class BothSpellings(TyperCommand):
    """Accept `--world_size` for `--world-size` (DeepSpeed users type underscores); help shows one."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        known = {opt for p in self.params for opt in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
        out: list[str] = []
        for i, arg in enumerate(args):
            if arg == "--":
                out.extend(args[i:])
                break
            if arg.startswith("--") and "_" in arg:
                name, eq, value = arg.partition("=")
                hyphen = name.replace("_", "-")
                if name not in known and hyphen in known:
                    arg = hyphen + eq + value
            out.append(arg)
        return super().parse_args(ctx, out)


app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


def world_size_from_options(
    *,
    world_size: int | None,
    num_gpus: int | None,
    num_nodes: int | None,
    hostfile: Path | None,
    launcher: Any = None,
    config_dir: Path | None = None,
) -> tuple[int | None, str]:
    """The data-parallel world size the flags (or the config's `launcher:`) describe, and how.

    Flags win over the config's launcher section, as they do for `zerorun` itself.
    """
    if world_size is not None:
        if num_gpus is not None or num_nodes is not None or hostfile is not None:
            raise typer.BadParameter("give either --world-size or --num_gpus/--num_nodes/--hostfile, not both")
        return world_size, f"--world-size {world_size}"
    from_config = False
    if launcher is not None:
        num_gpus = num_gpus if num_gpus is not None else launcher.num_gpus
        num_nodes = num_nodes if num_nodes is not None else launcher.num_nodes
        if hostfile is None and launcher.hostfile:
            hostfile, from_config = Path(launcher.hostfile).expanduser(), True
            if config_dir is not None and not hostfile.is_absolute():
                hostfile = config_dir / hostfile
    note = ""
    if hostfile is not None and from_config and not hostfile.exists():
        # Configs are often checked away from the cluster: fall back to the numbers alone.
        note = f" (launcher.hostfile {hostfile} is not on this machine)"
        hostfile = None
    if hostfile is not None:
        # As the launcher does: the hostfile's hosts, narrowed by include/exclude, the first
        # num_nodes of them and the first num_gpus slots of each.
        from zerorun.launch.hosts import parse_hostfile, select_hosts

        pool = parse_hostfile(hostfile)
        hosts = select_hosts(
            pool,
            include=getattr(launcher, "include", None),
            exclude=getattr(launcher, "exclude", None),
            num_nodes=num_nodes,
            num_gpus=num_gpus,
            source=str(hostfile),
        )
        total = sum(h.num_slots for h in hosts)
        return total, f"{len(hosts)} host(s) × slots from {hostfile} = {total}"
    if num_gpus is not None:
        nodes = num_nodes or 1
        return num_gpus * nodes, f"{num_gpus} per node × {nodes} node(s) = {num_gpus * nodes}{note}"
    if num_nodes is not None:
        raise typer.BadParameter("--num_nodes needs --num_gpus (ranks per node) or --hostfile")
    return None, f"unknown (give --world-size, --num_gpus or --hostfile){note}"


# -- the resolved config, flattened -----------------------------------------------------------


def _rows(model: BaseModel, prefix: str, show_all: bool, parent_acted: bool = True) -> list[tuple[str, Any, bool, bool]]:
    """(dotted key, value, differs from default, set by user) for the keys worth showing."""
    rows: list[tuple[str, Any, bool, bool]] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        acted = parent_acted and extra.get("acted_on", True) is not False
        is_set = name in model.model_fields_set
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            sub = _rows(value, key + ".", show_all, acted)
            rows.extend(sub)
            continue
        default = info.get_default(call_default_factory=True)
        # Unset keys hold the default (or, like overlap_comm, what zerorun resolves it to).
        differs = is_set and value != default
        show = show_all or is_set or (acted and prefix != "launcher." and value is not None)
        if show:
            rows.append((key, value, differs, is_set))
    return rows


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**5:
        # Sizes read best the way configs write them: 5e8, 2.5e7; anything else grouped.
        for digits in (0, 1):
            short = f"{value:.{digits}e}"
            if float(short) == value:
                mantissa, exponent = short.split("e")
                return f"{mantissa}e{int(exponent)}"
        return f"{value:_}"
    return str(value)


# -- the command ------------------------------------------------------------------------------


@app.command(cls=BothSpellings, no_args_is_help=True)
@report_errors
def print_config(
    config: Annotated[
        Path, typer.Argument(metavar="CONFIG", help="DeepSpeed JSON (comments allowed) or YAML config.", show_default=False)
    ],
    world_size: Annotated[
        int | None, typer.Option("--world-size", min=1, help="Data-parallel world size (all ranks).", show_default=False)
    ] = None,
    num_gpus: Annotated[
        int | None, typer.Option("--num-gpus", "--nproc-per-node", min=1, help="Ranks per node (with --num_nodes).", show_default=False)
    ] = None,
    num_nodes: Annotated[int | None, typer.Option("--num-nodes", min=1, help="Number of nodes.", show_default=False)] = None,
    hostfile: Annotated[
        Path | None, typer.Option("--hostfile", help="DeepSpeed hostfile: world size = its slots.", show_default=False)
    ] = None,
    params: Annotated[
        str | None,
        typer.Option("--params", help="Model size (e.g. 7.5e9, 7B, 350M): adds the memory estimate.", show_default=False),
    ] = None,
    largest_layer: Annotated[
        str | None, typer.Option("--largest-layer", help="Elements of the largest layer (stage 2) or parameter group (stage 3: a module, e.g. embeddings + head): sizes the buffers.", show_default=False)
    ] = None,
    units: Annotated[str, typer.Option("--units", help="GB (1e9 bytes) or GiB (2^30).")] = "GB",
    show_all: Annotated[bool, typer.Option("--all", help="Show every key, not only the ones zerorun acts on.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Validate CONFIG and print the resolved settings, batch arithmetic, warnings and notices."""
    from zerorun.config import load_config
    from zerorun.estimate import model_state_bytes, parse_count

    unit = _unit(units)
    try:
        num_params = parse_count(params) if params is not None else None
        layer = parse_count(largest_layer) if largest_layer is not None else None
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None

    try:
        loaded = load_config(config)
        n, how = world_size_from_options(
            world_size=world_size,
            num_gpus=num_gpus,
            num_nodes=num_nodes,
            hostfile=hostfile,
            launcher=loaded.config.launcher,
            config_dir=config.parent,
        )
        batch = loaded.resolve_batch(n)
    except ZerorunError as err:
        if as_json:
            problems = getattr(err, "problems", None) or [str(err)]
            print(json.dumps({"valid": False, "path": str(config), "errors": problems}, indent=2))
            sys.exit(err.exit_code)
        raise
    estimate = None
    est_notes: list[str] = []
    if num_params is not None:
        if n is None:
            est_notes.append("world size unknown: estimate for 1 rank (give --world-size, --num_gpus or --hostfile)")
        estimate = model_state_bytes(num_params, n or 1, loaded.config, largest_layer=layer)

    if as_json:
        doc = {
            "valid": True,
            "path": str(config),
            "format": loaded.format,
            "world_size": n,
            "world_size_from": how,
            "config": loaded.config.to_dict(only_set=False),
            "user_config": loaded.config.to_dict(only_set=True),
            "non_default": [k for k, _, differs, _ in _rows(loaded.config, "", True) if differs],
            "batch": batch.as_dict(),
            "open_autos": loaded.open_autos,
            "warnings": loaded.warnings,
            "notices": loaded.notices,
            "memory": None if estimate is None else {**estimate.as_dict(), "notes": [*est_notes, *estimate.notes]},
            "errors": [],
        }
        print(json.dumps(doc, indent=2))
        return
    _render(config, loaded, n, how, batch, estimate, est_notes, unit, show_all)


def _unit(units: str) -> tuple[str, float]:
    from zerorun.estimate import GB, GIB

    key = units.strip().lower()
    if key in ("gb", "g"):
        return "GB", GB
    if key in ("gib", "gi"):
        return "GiB", GIB
    raise typer.BadParameter(f"--units {units!r}: use GB (1e9 bytes) or GiB (2^30 bytes)")


def _render(config: Path, loaded: Any, n: int | None, how: str, batch: Any, estimate: Any, est_notes: list[str],
            unit: tuple[str, float], show_all: bool) -> None:  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    from zerorun.config import OPEN_NOTE

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 200  # piped output: long keys and messages on one line each
    fmt = {"json": "DeepSpeed JSON", "yaml": "YAML"}.get(loaded.format, loaded.format)
    console.print(f"[bold]zerorun print-config[/bold] {config} ({fmt}); world size: {how}", markup=True)

    table = Table(title="resolved configuration  (* = differs from DeepSpeed's default)", title_justify="left",
                  show_header=True, header_style="bold", box=None, pad_edge=False)  # fmt: skip
    table.add_column("key")
    table.add_column("", width=1)
    table.add_column("value")
    for key, value, differs, _ in _rows(loaded.config, "", show_all):
        text = _value_text(value)
        if value == "auto":
            table.add_row(key, "*", f"[magenta]auto[/magenta] ({OPEN_NOTE})")
        elif differs:
            table.add_row(f"[bold]{key}[/bold]", "[yellow]*[/yellow]", f"[bold yellow]{_esc(text)}[/bold yellow]")
        else:
            table.add_row(f"[dim]{key}[/dim]", "", f"[dim]{_esc(text)}[/dim]")
    console.print(table)

    console.print("\n[bold]batch[/bold]  train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size")
    for line in batch.lines:
        console.print(f"  {line}", markup=False)
    if loaded.open_autos:
        console.print(f"\n[bold]open \"auto\" values[/bold] -- {OPEN_NOTE}:")
        for key in loaded.open_autos:
            console.print(f"  - {key}", markup=False)

    if estimate is not None:
        _render_estimate(console, estimate, est_notes, unit)

    if loaded.warnings:
        console.print(f"\n[bold yellow]warnings ({len(loaded.warnings)})[/bold yellow]")
        for w in loaded.warnings:
            console.print(f"  [yellow]![/yellow] {_esc(w)}")
    if loaded.notices:
        console.print(f"\n[bold cyan]notices ({len(loaded.notices)})[/bold cyan]: DeepSpeed keys zerorun accepts but does not act on")
        for note in loaded.notices:
            console.print(f"  [cyan]i[/cyan] {_esc(note)}")
    w, k = len(loaded.warnings), len(loaded.notices)
    console.print(
        f"\n[bold green]valid[/bold green]: {w} warning{'s' * (w != 1)}, {k} notice{'s' * (k != 1)}"
    )


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _render_estimate(console: Any, est: Any, notes: list[str], unit: tuple[str, float]) -> None:
    from rich.table import Table

    from zerorun.estimate import TERMS

    name, scale = unit
    bpe = est.bytes_per_element
    console.print(
        f"\n[bold]memory of model states[/bold] per rank: Ψ = {est.num_params:,} parameters, N = {est.world_size} "
        f"ranks, stage {est.stage}, {bpe.precision}, {bpe.optimizer} ({name}; activations not included)"
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("term")
    table.add_column("formula")
    for device in ("gpu", "cpu", "nvme"):
        table.add_column(device.upper() if device != "cpu" else "host", justify="right")
    for term in TERMS:
        cells = [f"{est.terms[d][term] / scale:.2f}" if est.terms[d][term] else "-" for d in ("gpu", "cpu", "nvme")]
        table.add_row(term, est.formulas[term], *cells)
    table.add_row("[bold]model states[/bold]", "after backward (peak)", *[f"[bold]{est.model_states(d) / scale:.2f}[/bold]" for d in ("gpu", "cpu", "nvme")])
    table.add_row("model states", "between steps (no GPU grads)", *[f"{est.between_steps(d) / scale:.2f}" for d in ("gpu", "cpu", "nvme")])
    for device in ("gpu", "cpu"):
        for buf, size in est.buffers.get(device, {}).items():
            cells = [f"{size / scale:.2f}" if d == device else "" for d in ("gpu", "cpu", "nvme")]
            table.add_row(f"buffer: {buf}", "upper bound", *cells)
    table.add_row("[bold]total with buffers[/bold]", "", *[f"[bold]{est.total(d) / scale:.2f}[/bold]" for d in ("gpu", "cpu", "nvme")])
    console.print(table)
    for note in [*notes, *est.notes]:
        console.print(f"  note: {note}", markup=False)

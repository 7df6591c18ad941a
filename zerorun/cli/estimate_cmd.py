"""`zerorun estimate --params P`: memory of model states per GPU and per host, for every ZeRO
stage and offload choice (zerorun/estimate/ holds the arithmetic; this is only the CLI)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from zerorun.cli.config_cmds import BothSpellings
from zerorun.cli.errors import report_errors

__all__ = ["app"]

app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@app.command(cls=BothSpellings, no_args_is_help=True)
@report_errors
def estimate(
    params: Annotated[
        str, typer.Option("--params", help="Trainable parameters: 7.5e9, 7.5B, 350M, ...", show_default=False)
    ],
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, help="GPUs (ranks) per node.")] = 8,
    nodes: Annotated[int, typer.Option("--nodes", "--num-nodes", min=1, help="Number of nodes.")] = 1,
    largest_layer: Annotated[
        str | None,
        typer.Option("--largest-layer", help="Elements of the largest layer (stage 2) or parameter group (stage 3: a module, e.g. embeddings + head): sizes the buffers.", show_default=False),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="Follow this config's precision, optimizer and buckets.", show_default=False),
    ] = None,
    units: Annotated[str, typer.Option("--units", help="GB (1e9 bytes) or GiB (2^30).")] = "GB",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Per-GPU and per-host memory of model states for ZeRO stages 0-3 × offload choices.

    Without --config: the ZeRO paper's model (mixed-precision Adam: 2Ψ params + 2Ψ grads +
    12Ψ optimizer states). Activations are not included.
    """
    from zerorun.cli.config_cmds import _unit
    from zerorun.estimate import BytesPerElement, estimate_table, model_state_bytes, parse_count

    try:
        num_params = parse_count(params)
        layer = parse_count(largest_layer) if largest_layer is not None else None
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    unit_name, scale = _unit(units)
    loaded = None
    if config is not None:
        from zerorun.config import load_config

        loaded = load_config(config)
    cfg = loaded.config if loaded is not None else None
    rows = estimate_table(num_params, gpus_per_node, nodes, cfg, largest_layer=layer)
    world = gpus_per_node * nodes
    mine = None
    if cfg is not None:
        mine = model_state_bytes(num_params, world, cfg, largest_layer=layer)
    bpe = rows[0][2].bytes_per_element if rows else BytesPerElement.paper()

    def row_dict(stage: int, label: str, est: Any) -> dict[str, Any]:
        return {
            "stage": stage,
            "offload": label,
            "per_gpu_bytes": est.model_states("gpu"),
            "per_gpu_between_steps_bytes": est.between_steps("gpu"),
            "per_gpu_formula": est.formula("gpu"),
            "per_host_bytes": est.model_states("cpu") * gpus_per_node,
            "per_host_nvme_bytes": est.model_states("nvme") * gpus_per_node,
            "gpu_buffer_bytes": est.buffer_bytes("gpu"),
            "host_buffer_bytes": est.buffer_bytes("cpu") * gpus_per_node,
            "per_rank": est.as_dict()["per_rank"],
        }

    if as_json:
        doc = {
            "num_params": num_params,
            "gpus_per_node": gpus_per_node,
            "nodes": nodes,
            "world_size": world,
            "model": "config" if cfg is not None else "zero-paper",
            "precision": bpe.precision,
            "optimizer": bpe.optimizer,
            "bytes_per_element": {"params": bpe.params, "grads": bpe.grads, "master": bpe.master,
                                  "optimizer_states": bpe.optimizer_states},  # fmt: skip
            "units": "bytes",
            "point": "per_gpu_bytes: after the backward (gradients alive, the peak of model states); "
            "per_gpu_between_steps_bytes: after the optimizer step (GPU gradients freed)",
            "activations": "not included",
            "rows": [row_dict(*r) for r in rows],
            "config_choice": None if mine is None else mine.as_dict(),
            "warnings": loaded.warnings if loaded is not None else [],
            "notes": sorted({n for r in rows for n in r[2].notes}),
        }
        print(json.dumps(doc, indent=2))
        return
    _render(num_params, gpus_per_node, nodes, rows, mine, config, unit_name, scale, loaded)


def _render(num_params: int, gpus_per_node: int, nodes: int, rows: list[tuple[int, str, Any]], mine: Any,
            config: Path | None, unit_name: str, scale: float, loaded: Any) -> None:  # fmt: skip
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 200
    world = gpus_per_node * nodes
    bpe = rows[0][2].bytes_per_element
    if config is None:
        model = "the ZeRO paper's model: mixed-precision Adam, 2Ψ params + 2Ψ grads + 12Ψ optimizer states"
    else:
        model = (
            f"{config}: {bpe.precision}, {bpe.optimizer}; bytes per element params {bpe.params}, grads {bpe.grads}, "
            f"master {bpe.master}, optimizer states {bpe.optimizer_states}"
        )
    console.print(
        f"[bold]memory of model states[/bold] for Ψ = {num_params:,} parameters on {nodes} node(s) × "
        f"{gpus_per_node} GPUs = {world} ranks"
    )
    console.print(f"  {escape(model)}")
    console.print(f"  {unit_name} = {'1e9 bytes' if unit_name == 'GB' else '2^30 bytes'}; activations are not included")
    console.print(
        "  per GPU = after the backward (gradients alive: the peak of model states); between steps = after the "
        "optimizer step (GPU gradients freed)"
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("stage", "right"), ("offload", "left"), ("per GPU", "right"), ("formula", "left"), ("between steps", "right"),
                          ("per host (CPU)", "right"), ("per host (NVMe)", "right"), ("+ GPU buffers ≤", "right")):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for stage, label, est in rows:
        chosen = mine is not None and stage == mine.stage and _label(mine) == label
        cells = [
            str(stage),
            label,
            f"{est.model_states('gpu') / scale:.1f}",
            est.formula("gpu"),
            f"{est.between_steps('gpu') / scale:.1f}",
            f"{est.model_states('cpu') * gpus_per_node / scale:.1f}",
            f"{est.model_states('nvme') * gpus_per_node / scale:.1f}" if est.model_states("nvme") else "-",
            f"{est.buffer_bytes('gpu') / scale:.2f}",
        ]
        if chosen:
            cells = [f"[bold yellow]{c}[/bold yellow]" for c in cells]
            cells[1] += " [yellow]◀ your config[/yellow]"
        table.add_row(*cells)
    console.print(table)
    if mine is not None and _label(mine) not in ("none", "optimizer", "optimizer+params"):
        console.print(
            f"  your config (stage {mine.stage}, offload_optimizer {mine.offload_optimizer}, offload_param "
            f"{mine.offload_param}): per GPU {mine.model_states('gpu') / scale:.1f}, per host "
            f"{mine.model_states('cpu') * gpus_per_node / scale:.1f}, NVMe per host "
            f"{mine.model_states('nvme') * gpus_per_node / scale:.1f} {unit_name}"
        )
    notes = sorted({n for _, _, est in rows for n in est.notes})
    for note in notes:
        console.print(f"  note: {escape(note)}")
    console.print(
        "  buffers (upper bound): gradient staging buckets at stage 2; at stage 3 the gathered parameter groups "
        "(root + running group, kept and prefetched ones), one group's staging and gradients; as the config and "
        "--largest-layer size them (DeepSpeed's defaults without --config), capped at the model size"
    )
    if loaded is not None and loaded.warnings:
        console.print(f"  [yellow]{len(loaded.warnings)} config warning(s)[/yellow]: see zerorun print-config {config}")


def _label(est: Any) -> str:
    if est.offload_optimizer == "none" and est.offload_param == "none":
        return "none"
    if est.offload_optimizer == "cpu" and est.offload_param == "none":
        return "optimizer"
    if est.offload_optimizer == "cpu" and est.offload_param == "cpu":
        return "optimizer+params"
    return f"{est.offload_optimizer}/{est.offload_param}"

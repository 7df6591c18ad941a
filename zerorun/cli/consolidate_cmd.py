"""`zerorun consolidate CKPT_DIR OUT`: a full state dict from a sharded checkpoint.

torch is imported inside the command only: `zerorun consolidate --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

from zerorun.cli.errors import report_errors
from zerorun.errors import CheckpointError
from zerorun.sizes import parse_size

__all__ = ["app"]

app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})

@app.command()
@report_errors
def consolidate(
    ckpt_dir: Path = typer.Argument(..., help="Checkpoint save directory (with 'latest') or a tag directory."),
    out: Path = typer.Argument(..., help="Output directory for the consolidated weights."),
    tag: str | None = typer.Option(None, "--tag", help="Checkpoint tag (default: the one 'latest' names)."),
    dtype: str = typer.Option(
        "fp32", "--dtype", help="fp32 | bf16 | fp16 | auto (the dtype it trained in), for floating-point tensors."
    ),
    fmt: str = typer.Option("safetensors", "--format", help="safetensors | torch"),
    max_shard_size: str = typer.Option(
        "5GB", "--max_shard_size", "--max-shard-size", help="Largest output file, e.g. 5GB, 500MB, 2GiB."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace model files already in OUT."),
) -> None:
    """Build a full state dict (Hugging Face layout) from a sharded checkpoint, one tensor at a time."""
    if dtype not in ("fp32", "bf16", "fp16", "auto"):
        raise CheckpointError(f"--dtype {dtype!r}: use fp32, bf16, fp16 or auto")
    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"--format {fmt!r}: use safetensors or torch")
    limit = parse_size(max_shard_size)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")

    from zerorun.runtime.checkpoint.consolidate import consolidate as run

    def progress(path: Path, size: int) -> None:
        typer.echo(f"  wrote {path.name} ({size / 1e9:.3f} GB)", err=True)

    result = run(
        ckpt_dir, out, tag=tag, dtype=None if dtype == "auto" else dtype, fmt=fmt, max_shard_size=limit,
        overwrite=overwrite, on_file=progress,
    )
    gb = result.total_bytes / 1e9
    typer.echo(
        f"consolidated {result.tag_dir}: {result.num_tensors} tensors, {gb:.3f} GB ({dtype}) "
        f"-> {len(result.files)} file(s) in {out}"
    )
    if result.tied:
        typer.echo("tied weights written once: " + ", ".join(f"{a} -> {c}" for a, c in result.tied.items()))

"""`zerorun consolidate CKPT_DIR OUT`: a full state dict from a sharded checkpoint.

torch is imported inside the command only: `zerorun consolidate --help` stays fast.
"""

from __future__ import annotations

import re
from pathlib import Path

import typer

from zerorun.cli.errors import report_errors
from zerorun.errors import CheckpointError

__all__ = ["app", "parse_size"]

app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000 (Hugging Face's convention:
    GB is decimal, GiB binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise CheckpointError(f"--max_shard_size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise CheckpointError(f"--max_shard_size {text!r} must be positive")
    return n


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

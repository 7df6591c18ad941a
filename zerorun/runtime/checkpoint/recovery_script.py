#!/usr/bin/env python
"""zero_to_fp32.py, as zerorun writes it into a checkpoint directory under --deepspeed-compat.

DeepSpeed copies its ``zero_to_fp32.py`` next to every checkpoint; this is zerorun's, with the
same command line. It consolidates the zerorun files of the checkpoint (the DeepSpeed-layout
files beside them also work with DeepSpeed's own script) into fp32 weights:

    python zero_to_fp32.py . output_dir/ [--safe_serialization] [-t TAG] [--max_shard_size 5GB]

Needs zerorun installed (as DeepSpeed's script needs DeepSpeed); same as
``zerorun consolidate CHECKPOINT_DIR OUTPUT_DIR``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="the directory with `latest` (or a tag directory)")
    parser.add_argument("output_dir", help="where model.safetensors / pytorch_model.bin (+ index) go")
    parser.add_argument("--max_shard_size", default="5GB", help="e.g. 5GB, 500MB, 2GiB (as zerorun consolidate)")
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors instead of torch files")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the `latest` file)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    if args.exclude_frozen_parameters:
        parser.error("--exclude_frozen_parameters: zerorun's checkpoints keep every parameter; drop the option")
    try:
        from zerorun.errors import ZerorunError
        from zerorun.runtime.checkpoint import consolidate
        from zerorun.sizes import parse_size
    except ImportError:
        sys.stderr.write("zero_to_fp32.py: this checkpoint was written by zerorun; install zerorun to run it\n")
        return 1
    try:
        result = consolidate(
            args.checkpoint_dir,
            args.output_dir,
            tag=args.tag,
            dtype="fp32",
            fmt="safetensors" if args.safe_serialization else "torch",
            max_shard_size=parse_size(args.max_shard_size),
        )
    except ZerorunError as err:
        sys.stderr.write(f"zero_to_fp32.py: {err}\n")
        return 1
    print(f"wrote {result.num_tensors} tensors ({result.total_bytes} bytes) from {result.tag_dir} to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

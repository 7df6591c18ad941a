"""``deepspeed.add_config_arguments``: the arguments DeepSpeed adds to a script's parser."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--deepspeed``, ``--deepspeed_config`` (and the old ``--deepscale`` spellings), as
    DeepSpeed does; ``deepspeed.initialize(args=args)`` reads ``args.deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (zerorun)")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (helper flag for user code)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser

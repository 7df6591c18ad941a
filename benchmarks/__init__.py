"""Benchmarks of zerorun against its peers (plain PyTorch, DDP, FSDP2); see benchmarks/README.md.

Not part of the installed package: run from the repository root, e.g.
`python benchmarks/train_bench.py --size 1.3B --configs quick`.
"""

"""``alignopsd memory --config FILE [--world-size N] [--gpu-gib G]``: per-rank memory of a Megatron run's config.

The arithmetic and its legend: engine/policy/megatron/memory.py.
"""

from __future__ import annotations

import argparse

from alignopsd.engine.config.schema import load_config
from alignopsd.engine.policy.megatron.memory import describe, format_table, layout_from_config

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="alignopsd memory", description="Per-rank memory of a Megatron run's config.")
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V", help="config override")
    p.add_argument("--world-size", type=int, default=None, help="ranks in all (default: tensor_parallel_size)")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one accelerator in GiB (default 80)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    world = args.world_size if args.world_size is not None else cfg.policy.tensor_parallel_size
    layout, source = layout_from_config(cfg, world, args.gpu_gib)
    print(describe(layout, source))
    print()
    print(format_table(layout))
    return 0

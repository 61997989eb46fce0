"""``alignopsd memory --config FILE [--world-size N] [--gpu-gib G]``: per-rank memory of a Megatron run's config.

The arithmetic and its legend: engine/lab/megatron_memory.py.
"""

from __future__ import annotations

import argparse

from alignopsd.engine.config.schema import RunConfig, load_config
from alignopsd.engine.lab.megatron_memory import GIB, Layout, describe, format_table, model_dims

from alignopsd.estimators import get_estimator

__all__ = ["layout_from_config", "main"]


def layout_from_config(cfg: RunConfig, world_size: int, gpu_gib: float) -> tuple[Layout, str]:
    """(the per-rank layout of run config ``cfg`` on ``world_size`` ranks of ``gpu_gib`` GiB, shape source)."""
    if cfg.policy.backend != "megatron":
        raise ValueError(f"policy.backend: the report describes the megatron backend, got {cfg.policy.backend!r}")
    dims, dtype_bytes, source = model_dims(cfg.model.name, cfg.model.dtype)
    tp = cfg.policy.tensor_parallel_size
    if world_size < 1 or world_size % tp:
        raise ValueError(f"--world-size: must be a positive multiple of tensor_parallel_size = {tp}, got {world_size}")
    g = cfg.generation
    vllm = g.backend == "vllm"
    layout = Layout(
        dims=dims,
        dtype_bytes=dtype_bytes,
        tp=tp,
        dp=world_size // tp,
        distributed_optimizer=cfg.policy.distributed_optimizer,
        reference=get_estimator(cfg.algorithm.estimator).phases(cfg.algorithm).ref,
        hf_generation=not vllm,
        vllm=vllm,
        vllm_sleep=vllm and g.vllm_sleep is not False,
        gpu_bytes=int(gpu_gib * GIB),
        gpu_memory_utilization=float(g.gpu_memory_utilization),
    )
    return layout, source


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

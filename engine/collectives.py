"""The few collectives the step and the trainer need over data-parallel ranks (identity when single-process)."""

from __future__ import annotations

import torch

from .metric_reduce import Samples, reduce_over_ranks

REDUCE_OPS = ("sum", "max", "min")


def all_reduce(values: list[float], op: str, world_size: int, group=None) -> list[float]:
    """All-reduce a few floats across the data-parallel ranks of ``group`` (float64; on the GPU under NCCL)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op: expected one of {REDUCE_OPS}, got {op!r}")
    if world_size <= 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(t, op=red, group=group)
    return t.cpu().tolist()


def reduce_metrics(gathered: list[dict[str, float]], samples: Samples | None = None) -> dict[str, float]:
    """One metric dict from the dicts of the contributing ranks, each key by its declared kind (sum, weighted
    mean, min, max, percentiles from the gathered ``samples``): see ``engine/metric_reduce.py``."""
    return reduce_over_ranks(gathered, samples)


def all_gather_tensors(t: torch.Tensor, world_size: int, group=None) -> list[torch.Tensor]:
    """Every data-parallel rank's ``t`` in rank order (its first dimension may differ between ranks), exact
    copies on ``t``'s device (on the GPU in transit under NCCL). Single-process: ``[t]``."""
    if world_size <= 1:
        return [t]
    import torch.distributed as dist

    dev = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    x = t.detach().to(dev).contiguous()
    n = torch.tensor([x.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n, group=group)
    counts = [int(s) for s in sizes]
    padded = torch.zeros((max(max(counts), 1), *x.shape[1:]), dtype=x.dtype, device=dev)
    padded[: x.shape[0]] = x
    bufs = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(bufs, padded, group=group)
    return [b[:c].to(t.device) for b, c in zip(bufs, counts)]

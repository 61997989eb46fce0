"""The few collectives the step and the trainer need over data-parallel ranks (identity when single-process).

Every collective the engine calls, and the NCCL constraint each meets (torch.distributed's documentation: tensor
collectives need tensors on the rank's own GPU; object collectives, ``barrier`` and tensors made with a bare
``"cuda"`` use ``torch.cuda.current_device()``, so ``torch.cuda.set_device(local_rank)`` must precede them; the
trainer's ``Dist`` and Megatron's ``init_parallel`` call it before the process group is made or used):

    all_reduce (here; Trainer ``Dist.all_reduce``)        float64 scalars moved to the current CUDA device under NCCL
    all_gather (here, ``all_gather_tensors``)             sizes and padded rows on the current CUDA device under NCCL
    all_gather_object (Trainer ``Dist.gather_objects``:   picklable Python values (metrics, samples, manifest entries)
      metrics, checkpoint manifest)                       staged on the current device; set_device done by ``Dist``
    barrier (Trainer ``Dist.barrier``, Megatron save)      current device (set_device done first)
    broadcast_object_list (``tp_broadcast``: rollout,     tensors moved to the CPU before pickling; staged on
      teacher generation, encoding, M1 selection,         ``torch.cuda.current_device()`` passed as ``device``
      estimator output, lead failures)
    all_reduce (``MasterAdamW.all_reduce_grads``)          fp32 gradient buffers on the model's GPU
    broadcast (``HFPolicy`` start weights)                parameters and buffers on the model's GPU
    DistributedDataParallel (``HFPolicy``, fp32 models)   ``device_ids=[the model's GPU]``
    all_gather / gather (Megatron ``_gather``, weights)   shards on the rank's GPU (NCCL supports gather since 1.11)
    all_gather_object (Megatron optimizer state, save)    the state moved to the CPU first (a pickled CUDA tensor
                                                          would be rebuilt on the sender's device index)
    all_reduce (kernels: vocab-parallel log-prob head)    partials and hidden gradients on the rank's GPU
    megatron-core's own (tensor-parallel layers, DDP,     megatron-core's responsibility; ``init_parallel`` sets the
      distributed optimizer)                              device before ``initialize_model_parallel``
"""

from __future__ import annotations

import torch
from alignopsd.engine.parallel.metric_reduce import reduce_over_ranks

REDUCE_OPS = ("sum", "max", "min")


def all_reduce(values: list[float], op: str, world_size: int, group=None) -> list[float]:
    """All-reduce a few floats across the data-parallel ranks of ``group`` (float64; on the GPU under NCCL)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op: expected one of {REDUCE_OPS}, got {op!r}")
    if world_size <= 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(t, op=red, group=group)
    return t.cpu().tolist()


def collective_device(group=None) -> torch.device:
    """Where tensors of a collective over ``group`` live, and where object collectives stage: this rank's current
    CUDA device under NCCL (set with ``torch.cuda.set_device`` before the group was made), else the CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_metrics(gathered: list[dict[str, float]], *, strict: bool = False) -> dict[str, float]:
    """One metric dict from the dicts of the contributing ranks, each key by the reduction its value declares
    (sum, weighted mean, min/max over populated ranks, percentiles from the samples the values carry): see
    ``engine/parallel/metric_reduce.py``; ``strict``: an undeclared value raises."""
    return reduce_over_ranks(gathered, strict=strict)


def all_gather_tensors(t: torch.Tensor, world_size: int, group=None) -> list[torch.Tensor]:
    """Every data-parallel rank's ``t`` in rank order (its first dimension may differ between ranks), exact
    copies on ``t``'s device (on the GPU in transit under NCCL). Single-process: ``[t]``."""
    if world_size <= 1:
        return [t]
    import torch.distributed as dist

    dev = collective_device(group)
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

"""This process in a run: its rank, world size and collectives (:class:`Dist`), its device and its seeds."""

from __future__ import annotations

import os
import random
from typing import Any

from alignopsd.engine.config.schema import ConfigError, RunConfig
from alignopsd.engine.observe.strict import strict
from alignopsd.engine.parallel.collectives import all_reduce, reduce_metrics
from alignopsd.engine.parallel.group import start_process_group
from alignopsd.engine.parallel.hardware import device_type


class Dist:
    """Rank, world size and the collectives the trainer needs (no-ops when single-process)."""

    def __init__(self, device_kind: str) -> None:
        import torch.distributed as dist

        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = self.world_size > 1
        self.owns_group = self.enabled and not dist.is_initialized()  # close() destroys only a group it made
        if self.enabled and device_kind == "cuda":  # NCCL's object collectives and barrier use the current device
            import torch

            torch.cuda.set_device(self.local_rank)
        if self.owns_group:
            start_process_group(device_kind)  # NCCL or gloo, this attempt's own (parallel/group.py)
        self._dist = dist

    def barrier(self) -> None:
        if self.enabled:
            self._dist.barrier()

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """A few floats reduced over every rank of the run (the one collective: parallel/collectives.py)."""
        return all_reduce(values, op, self.world_size)

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def reduce_metrics(self, metrics: dict[str, float], *, lead: bool = True) -> dict[str, float]:
        """Metrics over the run's ranks (``collectives.reduce_metrics``: each key by the reduction its value
        declares, the percentiles from the samples the values carry; an undeclared value raises in strict mode).

        Under tensor parallelism the ranks of one group play the same tasks, so only the group's first rank
        (``lead``) contributes (otherwise counts would be multiplied by the tensor-parallel size). Single-process the
        values are this process's own, and their declarations are checked all the same. Collective."""
        if not self.enabled:
            return reduce_metrics([metrics], strict=strict())
        got = [g for g, first in self.gather_objects((metrics, lead)) if first]
        return reduce_metrics(got, strict=strict())

    def close(self) -> None:
        """Destroy the default process group if this context made it (a caller's own group is left to it)."""
        if self.owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group()


def pick_device(cfg: RunConfig, local_rank: int = 0):
    import torch

    kind = device_type(cfg.trainer.device)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device: 'cuda' requested but CUDA is not available")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def process_settings(cfg: RunConfig, rank: int = 0) -> None:
    """This process's torch threads (``trainer.torch_threads``), deterministic algorithms on the CPU
    (``trainer.deterministic``) and seeds (``trainer.seed`` + 1000 x ``rank``): set before a run's parts are built."""
    import torch

    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    if cfg.trainer.deterministic and device_type(cfg.trainer.device) == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    seed_everything(cfg.trainer.seed + 1000 * rank)

"""This process in a run: its rank, world size and collectives (:class:`Dist`), its device and its seeds."""

from __future__ import annotations

import os
import random
from typing import Any

from alignopsd.engine.config.schema import ConfigError, RunConfig
from alignopsd.engine.parallel.collectives import all_reduce
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
            dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo")
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

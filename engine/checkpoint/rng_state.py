"""The random generators' state of a process: what a checkpoint stores per rank (``rng_rank<r>.safetensors``,
engine/checkpoint/checkpoint.py) and what a resume restores, or derives for a rank the checkpoint has none for."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA when present) generator states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`capture_rng_state`'s states. CUDA: one state per device that is both saved and visible now
    (a resume may see fewer GPUs than the run that saved; devices beyond the saved ones keep their state)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        for i in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[i], i)


def derived_rng_state(seed: int, rank: int, step: int) -> None:
    """Seed python, numpy and torch (every visible CUDA device included) from (run seed, rank, step): the
    generator state of a rank that the checkpoint has none for (a resume on more data-parallel ranks), distinct
    from every other rank's and from this rank's state at the start of the run."""
    import hashlib

    h = hashlib.sha256(f"{int(seed)}:rng:{int(rank)}:{int(step)}".encode()).digest()
    s = int.from_bytes(h[:8], "little")
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)  # also seeds every CUDA device

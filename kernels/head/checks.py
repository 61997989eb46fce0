"""Input checks of the LM head's entries (``logprob.py``, ``fused_loss.py``): a ValueError naming the culprit.

Legend: N = tokens (flattened), H = hidden size, V = vocabulary size (or the local shard's size).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["check_lm_head_inputs", "check_target_range"]


def check_lm_head_inputs(hidden, weight, targets, bias, temperature) -> float:
    """Check hidden [..., H], weight [V, H] (same floating dtype and device), integer targets [...], bias [V] or None
    and a finite temperature > 0; returns 1 / temperature."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden: expected a floating tensor, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden: expected shape [..., H], got a scalar")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a floating [V, H] tensor, got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: hidden size {weight.shape[1]} does not match hidden's {hidden.shape[-1]}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    for name, t in (("weight", weight), ("targets", targets)):
        if t.device != hidden.device:
            raise ValueError(f"{name}: expected device {hidden.device}, got {t.device}")
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {getattr(bias, 'shape', bias)}")
        if bias.device != hidden.device:
            raise ValueError(f"bias: expected device {hidden.device}, got {bias.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature: expected a real number, got {temperature!r}")
    if not math.isfinite(float(temperature)) or float(temperature) <= 0:
        raise ValueError(f"temperature: must be finite and > 0, got {temperature}")
    return 1.0 / float(temperature)


def check_target_range(targets: Tensor, lo: int, hi: int, name: str = "targets") -> None:
    """ValueError unless every id of ``targets`` lies in ``[lo, hi)``."""
    if targets.numel() and (int(targets.min()) < lo or int(targets.max()) >= hi):
        raise ValueError(f"{name}: ids must lie in [{lo}, {hi}), got [{int(targets.min())}, {int(targets.max())}]")

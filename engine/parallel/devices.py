"""The device boundary: the one function through which a tensor crosses into a model's device.

Every backend (policy, reference and rescoring scorers, the Megatron row scorer) moves what it is given to its own
device with :func:`to_device` and hands results back where the caller keeps them. Callers call it through the
module (``devices.to_device``), so a test can watch every crossing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def to_device(x: Tensor | None, device: torch.device | str) -> Tensor | None:
    """``x`` on ``device`` (the same tensor when it is already there); None stays None."""
    if x is None:
        return None
    return x.to(device, non_blocking=True)


def module_device(model: nn.Module) -> torch.device:
    """The device of a module's first parameter (CPU for a module without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

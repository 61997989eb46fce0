"""When the algorithm core hands its work to the Triton kernels of ``alignopsd.kernels``.

CUDA tensors go to the kernels whenever triton is importable, so a CUDA user gets them without
changing a line; everything else stays on the core's torch path (same rules, tested equal).
``alignopsd.kernels.force_kernels()`` (Triton interpreter only, for tests) makes CPU tensors
kernel-eligible too. For CPU tensors this check never imports triton, so the core stays cheap to
import and to use without it.
"""

from __future__ import annotations

import sys

from torch import Tensor

__all__ = ["use_kernels"]

_DISPATCH = "alignopsd.kernels._dispatch"


def use_kernels(*tensors: Tensor | None) -> bool:
    """True when the core should call the kernel entries (with ``impl="triton"``) for these tensors."""
    if any(isinstance(t, Tensor) and t.is_cuda for t in tensors):
        from alignopsd.kernels._dispatch import core_uses_kernels  # noqa: PLC0415

        return core_uses_kernels(*tensors)
    dispatch = sys.modules.get(_DISPATCH)  # force_kernels() can only be active once its module is imported
    return dispatch is not None and dispatch.kernels_forced()

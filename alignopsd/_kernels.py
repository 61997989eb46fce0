"""When the algorithm core hands its work to the Triton kernels of ``alignopsd.kernels``.

CUDA tensors go to the Triton kernels whenever triton is importable, so a CUDA user gets them without
changing a line; everything else runs on the kernels' torch paths or the core's own (same rules, tested
equal). ``alignopsd.testing.force_kernels()`` (Triton interpreter only, for tests) makes CPU tensors
kernel-eligible too.
"""

from __future__ import annotations

from torch import Tensor

from alignopsd.kernels import core_uses_kernels

__all__ = ["use_kernels"]


def use_kernels(*tensors: Tensor | None) -> bool:
    """True when the core should call the kernel entries with ``impl="triton"`` for these tensors."""
    return core_uses_kernels(*(t for t in tensors if isinstance(t, Tensor)))

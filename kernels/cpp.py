"""The C++ extension (``alignopsd._C``) as the kernels' CPU paths see it: whether its bf16 kernels can run here.

Two custom CPU kernels live in the extension: the LM head's bf16 forward partials (``head/cpu_partials.py``,
csrc/lm_head_bf16.cpp) and the shared-prefix prefill attention (``attention_native.py``, csrc/attention_bf16.cpp).
Both need the same things of the process (:func:`native_ready`), and both hand the extension raw pointers whose
reach it checks against :func:`elements_from`.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # the C++ extension is optional (a build without a compiler falls back to the torch paths)
    from alignopsd import _C
except ImportError:  # pragma: no cover - depends on the build
    _C = None

__all__ = ["elements_from", "native_ready", "why_not_ready"]

_READY: bool | None = None


def native_ready() -> bool:
    """Whether the bf16 kernels (head, attention) can run in this process: the extension was built with them,
    the CPU has AVX512-BF16 (checked by the extension with cpuid) and torch's own CPU code runs at AVX512 (so
    ``ATEN_CPU_CAPABILITY=avx2``, which makes torch behave like an AVX2-only CPU, turns it off too)."""
    global _READY
    if _READY is None:
        _READY = bool(
            _C is not None
            and hasattr(_C, "attention_prefix_bf16")  # a build older than both kernels: torch paths
            and _C.has_avx512_bf16()
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        )
    return _READY


def why_not_ready() -> str:
    """Why the bf16 kernels cannot run in this process ("" when :func:`native_ready`), for the run's log."""
    if native_ready():
        return ""
    if _C is None or not hasattr(_C, "attention_prefix_bf16"):
        return "the C++ extension was built without the bf16 kernels"
    if not _C.has_avx512_bf16():
        return "this CPU has no AVX512-BF16"
    return f"torch's CPU code runs at {torch.backends.cpu.get_cpu_capability()}, below AVX512"


def elements_from(t: Tensor) -> int:
    """The elements of ``t``'s storage from its first element on: all a kernel handed ``t.data_ptr()`` may touch
    (the C++ boundary checks the sizes and strides it is given against it)."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()

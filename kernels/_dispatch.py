"""Implementation dispatch shared by the kernels.

``impl="auto"`` picks the Triton kernel when the tensors live on a CUDA device and the torch
CPU path otherwise; ``impl="triton"`` / ``impl="torch"`` force one. Triton kernels on CPU
tensors run only under the Triton interpreter (``TRITON_INTERPRET=1``), which is how the
tests exercise them without a GPU.

Kernels are written as plain Python functions and turned into Triton kernels lazily by
:func:`jit`, at first launch, not at import. ``triton.jit`` decides between the compiler and
the interpreter when it decorates a function, so decorating at launch time makes the choice
follow ``TRITON_INTERPRET`` as it is when the kernel is used, whichever module imported
triton first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:  # triton is optional: the torch paths work without it
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001  (ImportError, or a broken install without a driver)
    triton = None
    tl = None
    HAS_TRITON = False

IMPLS = ("auto", "triton", "torch")

_JIT_CACHE: dict[tuple[Callable, bool], Any] = {}


def interpret_mode() -> bool:
    """Whether the Triton interpreter is requested (``TRITON_INTERPRET`` set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for ``impl`` and the devices of ``tensors``.

    Raises ValueError for an unknown ``impl`` or a forced ``"triton"`` that cannot run.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl: unknown value {impl!r}; allowed: {', '.join(map(repr, IMPLS))}")
    on_cuda = any(t.is_cuda for t in tensors if t is not None)
    if impl == "auto":
        return "triton" if (on_cuda and HAS_TRITON) else "torch"
    if impl == "triton":
        if not HAS_TRITON:
            raise ValueError("impl: 'triton' requested but triton is not importable; use impl='torch'")
        if not on_cuda and not interpret_mode():
            raise ValueError(
                "impl: 'triton' on CPU tensors needs the Triton interpreter; set TRITON_INTERPRET=1 "
                "in the environment (before launching) or use impl='torch'"
            )
    return impl


def jit(fn: Callable) -> Any:
    """``triton.jit(fn)``, decorated now (compiler or interpreter per the current environment) and cached."""
    if not HAS_TRITON:
        raise ValueError("impl: triton is not importable")
    key = (fn, interpret_mode())
    kernel = _JIT_CACHE.get(key)
    if kernel is None:
        kernel = triton.jit(fn)
        _JIT_CACHE[key] = kernel
    return kernel


def upcast_dots(t: torch.Tensor) -> bool:
    """Whether kernels must cast operands to fp32 before ``tl.dot`` (the interpreter has no bf16 dot)."""
    return interpret_mode() or not t.is_cuda


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 ("ieee") for fp32 operands, like torch's default matmul."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_device(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device}, got {t.device}")

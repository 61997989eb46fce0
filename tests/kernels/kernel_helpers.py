"""Helpers shared by the kernel tests (three-way tolerance, impl grid)."""

from __future__ import annotations

import pytest
import torch
from alignopsd.kernels import HAS_TRITON

IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed"))]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


def assert_three_way(ours: torch.Tensor, plain: torch.Tensor, ref: torch.Tensor, *, atol: float, name: str = ""):
    """DESIGN example 2: |ours - ref| <= 2 |plain torch (same dtype) - ref| + atol."""
    e_ours = max_err(ours, ref)
    e_plain = max_err(plain, ref)
    assert e_ours <= 2 * e_plain + atol, (
        f"{name}: kernel error {e_ours:.3g} > 2 x plain-torch error {e_plain:.3g} + {atol}"
    )

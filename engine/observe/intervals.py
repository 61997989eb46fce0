"""Intervals over replicates: the 95 % Student's t-interval of a mean.

The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom is tabulated for df = 1..30 (to three
decimals) and above that given by the Cornish-Fisher expansion around the normal quantile (three terms; within
2e-6 of the exact value for df > 30), so no statistics package is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["mean_ci", "t_quantile_95"]

_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
_Z975 = 1.959963984540054


def t_quantile_95(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` >= 1 degrees of freedom (ValueError otherwise)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df: expected an integer >= 1, got {df!r}")
    if df <= len(_T95):
        return _T95[df - 1]
    z, v = _Z975, float(df)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
    )


def mean_ci(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, half-width of the 95 % t-interval, n) of the values, None and nan left out; the half-width is nan with
    fewer than 2 values, the mean nan with none."""
    xs = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    n = len(xs)
    if not n:
        return float("nan"), float("nan"), 0
    m = math.fsum(xs) / n
    if n < 2:
        return m, float("nan"), n
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    return m, t_quantile_95(n - 1) * sd / math.sqrt(n), n

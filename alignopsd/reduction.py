"""How a metric reduces over data-parallel ranks, declared where the metric is emitted.

Every rank computes its metrics on its share of the step's batch; the logged value must be the one a single rank
holding the whole batch would report. The emitter knows how (a count adds up, a rate is a mean over its own
population, a minimum over an empty population is undefined), so every metric value is emitted as a
:class:`Stat`: a ``float`` (it logs, compares and serialises as the plain number, so the metrics files do not
change) that carries its declared :class:`Reduce` kind and what that kind needs. The reduction over ranks
(``alignopsd.engine.parallel.metric_reduce``) reads only these declarations, never the metric's name.

    summed(v)                    counts and totals: the sum over ranks
    same(v)                      a whole-batch value every rank holds (config, an all-reduced norm): rank 0's
    slowest(v)                   a time: the maximum over ranks (the slowest rank sets the step's time)
    weighted_mean(v, n)          a mean (a rate, a ratio) over ``n`` items of this rank: sum(n_r v_r) / sum(n_r);
                                 a rank with n = 0 (its value undefined) is left out
    extreme_min(v, n), extreme_max(v, n)
                                 min / max over the ranks whose population (``n`` items) is not empty
    pooled_std(v, mean, n, ddof, samples=None)
                                 a std of ``n`` items with mean ``mean`` (``ddof``: the producer's convention):
                                 from the gathered samples when every rank has them, else pooled from (n, mean, std)
    percentile(v, q, n, samples) a ``q``-quantile (linear interpolation) recomputed from every rank's samples; left
                                 out (counted in ``metrics/unreduced``) when a rank carried none
    rms(v, n)                    a root mean square over ``n`` items: sqrt(sum(n_r v_r^2) / sum(n_r))
    pooled(v, formula, *sums)    a statistic of sums (a correlation, an effective sample size, a cell density):
                                 the sums are added over ranks and :data:`FORMULAS` ``[formula]`` applied to them

``n`` is the count itself (a number), so a per-category rate carries its own population. ``samples``: the handle
:func:`alignopsd.samples.record_samples` returned (None when nothing is recording: single-process runs copy no
values). A value emitted without a declaration (a plain float) is an error for the reduction in strict mode (the
test suite), single-process runs included.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "Reduce",
    "Stat",
    "extreme_max",
    "extreme_min",
    "FORMULAS",
    "percentile",
    "pooled",
    "pooled_std",
    "rms",
    "same",
    "slowest",
    "summed",
    "weighted_mean",
]


class Reduce(enum.Enum):
    SAME = "same"
    SUM = "sum"
    TIME = "time"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    STD = "std"
    QUANTILE = "quantile"
    RMS = "rms"
    POOLED = "pooled"


def _corr(n: float, sx: float, sy: float, sxy: float, sxx: float, syy: float) -> float:
    """Pearson correlation from n, sum x, sum y, sum xy, sum x^2, sum y^2 (0 when undefined)."""
    if n < 2:
        return 0.0
    cov, vx, vy = sxy - sx * sy / n, sxx - sx * sx / n, syy - sy * sy / n
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else 0.0


# name -> the statistic of its (summed) sums
FORMULAS: dict[str, Callable[..., float]] = {
    "corr": _corr,
    "ess": lambda k, sw, sww: sw * sw / (k * sww) if k > 0 and sww > 0 else 0.0,  # (sum w)^2 / (k sum w^2)
    "cell_density": lambda nnz, m: nnz / (m * m) if m > 0 else 0.0,  # nonzero cells of an m x m matrix
}


class Stat(float):
    """A metric value and its declared reduction (module docstring); arithmetic on it gives a plain float."""

    __slots__ = ("how", "count", "mean", "ddof", "q", "samples", "sums", "formula")

    def __new__(
        cls,
        value: Any,
        how: Reduce,
        count: Any = None,
        mean: Any = None,
        ddof: int = 0,
        q: Any = None,
        samples: Any = None,
        sums: tuple = (),
        formula: str | None = None,
    ) -> Stat:
        out = super().__new__(cls, float(value))
        out.sums, out.formula = tuple(float(s) for s in sums), formula
        out.how = how
        out.count = None if count is None else float(count)
        out.mean = None if mean is None else float(mean)
        out.ddof = int(ddof)
        out.q = None if q is None else float(q)
        out.samples = samples
        return out

    def __reduce__(self):
        return (
            Stat,
            (float(self), self.how, self.count, self.mean, self.ddof, self.q, self.samples, self.sums, self.formula),
        )

    def __repr__(self) -> str:
        return float.__repr__(self)


def summed(v: Any) -> Stat:
    return Stat(v, Reduce.SUM)


def same(v: Any) -> Stat:
    return Stat(v, Reduce.SAME)


def slowest(v: Any) -> Stat:
    return Stat(v, Reduce.TIME)


def weighted_mean(v: Any, n: Any) -> Stat:
    return Stat(v, Reduce.MEAN, count=n)


def extreme_min(v: Any, n: Any) -> Stat:
    return Stat(v, Reduce.MIN, count=n)


def extreme_max(v: Any, n: Any) -> Stat:
    return Stat(v, Reduce.MAX, count=n)


def pooled_std(v: Any, mean: Any, n: Any, ddof: int, samples: Any = None) -> Stat:
    return Stat(v, Reduce.STD, count=n, mean=mean, ddof=ddof, samples=samples)


def percentile(v: Any, q: float, n: Any, samples: Any) -> Stat:
    return Stat(v, Reduce.QUANTILE, count=n, q=q, samples=samples)


def rms(v: Any, n: Any) -> Stat:
    return Stat(v, Reduce.RMS, count=n)


def pooled(v: Any, formula: str, *sums: Any) -> Stat:
    if formula not in FORMULAS:
        raise ValueError(f"formula: expected one of {sorted(FORMULAS)}, got {formula!r}")
    return Stat(v, Reduce.POOLED, sums=sums, formula=formula)

"""The reduction of metrics over data-parallel ranks, by the declaration each value carries.

Every rank computes its metrics on its share of the step's batch; the logged value must be the one a single
rank holding the whole batch would report. Each emitter declares how its metric reduces where it emits it
(``alignopsd.reduction``: a :class:`~alignopsd.reduction.Stat` value with its ``Reduce`` kind, the count a mean
or an extreme is taken over, and the samples behind a percentile or a std); :func:`reduce_over_ranks` reads that
declaration and nothing else (never the metric's name):

    SAME      rank 0's value                      SUM       the sum
    TIME      the maximum (the slowest rank)      RMS       sqrt of the count-weighted mean of squares
    MEAN      weighted by each rank's count; ranks whose count is 0 (value undefined) are left out
    MIN, MAX  over the ranks whose population is not empty (count > 0, or no count declared)
    STD       from the gathered samples when every populated rank sent them, else pooled from (count, mean, std)
    QUANTILE  from the gathered samples (linear interpolation); without them on a populated rank it is left out
              and counted in ``metrics/unreduced`` (a percentile is never averaged)
    POOLED    the declared formula (``alignopsd.reduction.FORMULAS``) of the ranks' sums added up

A value without a declaration is an error in strict mode (the test suite); in a production run it is reported
once (a warning, and ``metrics/undeclared`` counts such keys in the step) and reduced conservatively: the plain
mean over the ranks that report it. A key whose ranks declare different kinds is treated the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from alignopsd.reduction import FORMULAS, Reduce, Stat

log = logging.getLogger("alignopsd.metrics")
_WARNED: set[str] = set()  # undeclared keys already reported by this process


class UndeclaredMetricError(ValueError):
    """A metric reached the reduction over ranks without a declaration (strict mode)."""


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (the definition of ``torch.quantile`` and ``numpy.quantile``)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def _populated(vals: list[Stat]) -> list[Stat]:
    return [v for v in vals if v.count is None or v.count > 0]


def _pooled_samples(vals: list[Stat]) -> list[float] | None:
    """Every populated rank's samples concatenated; None when one of them sent none."""
    out: list[float] = []
    for v in _populated(vals):
        if v.samples is None:
            return None
        out.extend(v.samples.values())
    return out


def _std(vals: list[Stat]) -> float:
    ddof = vals[0].ddof
    pooled = _pooled_samples(vals)
    if pooled is not None:
        n = len(pooled)
        if n - ddof <= 0:
            return 0.0
        mu = sum(pooled) / n
        return math.sqrt(sum((x - mu) ** 2 for x in pooled) / (n - ddof))
    parts = [(v.count or 0.0, v.mean or 0.0, float(v)) for v in vals if (v.count or 0.0) > 0]
    total = sum(n for n, _, _ in parts)
    if total - ddof <= 0:
        return 0.0
    mean = sum(n * mu for n, mu, _ in parts) / total
    ss = sum((n - ddof) * s * s + n * (mu - mean) ** 2 for n, mu, s in parts)
    return math.sqrt(max(ss, 0.0) / (total - ddof))


def _weighted(vals: list[Stat], square: bool = False) -> float:
    parts = [(v.count, float(v) ** 2 if square else float(v)) for v in vals if (v.count or 0.0) > 0]
    total = sum(n for n, _ in parts)
    if total <= 0:  # every rank's population is empty: the value every rank reports for that case
        return float(vals[0])
    mean = sum(n * x for n, x in parts) / total
    return math.sqrt(max(mean, 0.0)) if square else mean


def reduce_one(vals: list[Stat]) -> float | None:
    """One declared metric over the ranks that report it (module docstring); None: left out."""
    how = vals[0].how
    if how is Reduce.SAME:
        return float(vals[0])
    if how is Reduce.SUM:
        return float(sum(float(v) for v in vals))
    if how is Reduce.TIME:
        return float(max(float(v) for v in vals))
    if how is Reduce.MEAN:
        return _weighted(vals)
    if how is Reduce.RMS:
        return _weighted(vals, square=True)
    if how in (Reduce.MIN, Reduce.MAX):
        have = _populated(vals) or vals[:1]
        return float((min if how is Reduce.MIN else max)(float(v) for v in have))
    if how is Reduce.STD:
        return _std(vals)
    if how is Reduce.POOLED:
        if len({(v.formula, len(v.sums)) for v in vals}) > 1:
            return None
        return float(FORMULAS[vals[0].formula](*(sum(col) for col in zip(*(v.sums for v in vals)))))
    pooled = _pooled_samples(vals)  # QUANTILE
    if pooled is None:
        return None
    return _quantile(pooled, vals[0].q) if pooled else float(vals[0])


def reduce_over_ranks(gathered: Sequence[dict[str, Any]], *, strict: bool = False) -> dict[str, float]:
    """One metric dict from the contributing ranks' dicts (module docstring); keys a rank lacks (or holds as
    None) are reduced over the ranks that have them. ``strict``: an undeclared value raises
    :class:`UndeclaredMetricError`."""
    keys = list(dict.fromkeys(k for g in gathered for k in g))  # in the order the ranks emitted them
    out: dict[str, float] = {}
    unreduced = undeclared = 0
    for k in keys:
        vals = [g[k] for g in gathered if g.get(k) is not None]
        if not vals:
            continue
        if not all(isinstance(v, Stat) for v in vals) or len({v.how for v in vals}) > 1:
            if strict:
                raise UndeclaredMetricError(f"metric {k!r} has no reduction declaration (alignopsd.reduction)")
            if k not in _WARNED:
                _WARNED.add(k)
                log.warning("metric %r has no reduction declaration: reduced as the plain mean over ranks", k)
            undeclared += 1
            out[k] = sum(float(v) for v in vals) / len(vals)
            continue
        got = float(vals[0]) if len(vals) == 1 else reduce_one(vals)
        if got is None:
            unreduced += 1
            continue
        out[k] = got
    if unreduced:
        out["metrics/unreduced"] = float(unreduced)
    if undeclared:
        out["metrics/undeclared"] = float(undeclared)
    return out

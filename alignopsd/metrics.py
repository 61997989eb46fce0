"""The m2/* and episode/* diagnostics accumulator of Mechanism 2 (ALGORITHM.md §4.3)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from alignopsd.reduction import Stat, extreme_max, extreme_min, percentile, pooled, pooled_std, weighted_mean
from alignopsd.samples import record_samples

__all__ = ["Metrics"]


class Metrics:
    """Collects 0-d tensors and Python numbers, each with its declared reduction over data-parallel ranks
    (``alignopsd.reduction``); one device->host transfer at the end."""

    def __init__(self, device) -> None:
        self.device = device
        self.keys: list[str] = []
        self.vals: list[Tensor] = []
        self.floats: dict[str, float] = {}
        self.decl: dict[str, tuple[Callable[..., Stat], tuple]] = {}

    def put(self, key: str, value, how: Callable[..., Stat], *args) -> None:
        """``key`` = ``value`` declared as ``how(value, *args)`` (``args``: numbers or 0-d tensors, e.g. the count
        a mean is taken over)."""
        self.decl[key] = (how, args)
        if isinstance(value, Tensor):
            self.keys.append(key)
            self.vals.append(value.detach().reshape(()).to(torch.float64))
        else:
            self.floats[key] = float(value)

    def rate(self, key: str, flags: Tensor) -> None:
        n = flags.numel()
        self.put(key, flags.double().mean() if n else 0.0, weighted_mean, n)

    def dist(self, prefix: str, x: Tensor, quantiles: tuple[float, ...] = (0.95,), names: tuple[str, ...] = ()):
        names = names or tuple(f"p{round(q * 100)}" for q in quantiles)
        ref = record_samples(prefix, x, 0)
        n = x.numel()
        if n == 0:
            stats: list = [0.0] * (4 + len(quantiles))
        else:
            x = x.double()
            qs = torch.quantile(x, torch.tensor(quantiles, dtype=torch.float64, device=x.device)) if quantiles else None
            stats = [x.mean(), x.std(correction=0), x.min(), x.max()] + ([qs[i] for i in range(len(quantiles))])
        self._described(prefix, stats, n, ref, quantiles, names)

    def _described(self, prefix: str, stats: list, n: int, ref, quantiles, names) -> None:
        """mean, std (ddof 0), min, max and the quantiles of ``n`` values, declared."""
        mean = stats[0]
        self.put(f"{prefix}_mean", mean, weighted_mean, n)
        self.put(f"{prefix}_std", stats[1], pooled_std, mean, n, 0, ref)
        self.put(f"{prefix}_min", stats[2], extreme_min, n)
        self.put(f"{prefix}_max", stats[3], extreme_max, n)
        for q, name, v in zip(quantiles, names, stats[4:]):
            self.put(f"{prefix}_{name}", v, percentile, q, n, ref)

    def dists(self, named: dict[str, Tensor], quantile: float = 0.95) -> None:
        """mean/std/min/max/p95 of several equally long non-empty distributions in one batched pass."""
        keys = list(named)
        refs = [record_samples(k, named[k], 0) for k in keys]
        x = torch.stack([named[k].double() for k in keys])
        q = torch.quantile(x, quantile, dim=1)
        stats = torch.stack([x.mean(1), x.std(1, correction=0), x.amin(1), x.amax(1), q], 1)
        name = f"p{round(quantile * 100)}"
        for i, k in enumerate(keys):
            self._described(k, [stats[i, j] for j in range(5)], x.shape[1], refs[i], (quantile,), (name,))

    def corr(self, key: str, x: Tensor, y: Tensor) -> None:
        """Pearson correlation of ``x`` and ``y``, declared with its sums (n, sums of x, y, xy, x^2, y^2), from
        which the reduction over ranks computes the correlation of all the ranks' pairs."""
        n = x.numel()
        if n < 2:
            self.put(key, 0.0, pooled, "corr", n, 0, 0, 0, 0, 0)
            return
        x, y = x.double(), y.double()
        sums = (x.sum(), y.sum(), (x * y).sum(), (x * x).sum(), (y * y).sum())
        x = x - x.mean()
        y = y - y.mean()
        den = torch.sqrt((x * x).sum() * (y * y).sum())
        value = torch.where(den > 0, (x * y).sum() / den.clamp_min(1e-300), torch.zeros_like(den))
        self.put(key, value, pooled, "corr", n, *sums)

    def result(self) -> dict[str, float]:
        """Every value, declared (``alignopsd.reduction.Stat``; a plain float to everything but the reduction)."""
        raw = dict(self.floats)
        tensor_args = [a for _, args in self.decl.values() for a in args if isinstance(a, Tensor)]
        host: list[float] = []
        if self.vals or tensor_args:
            stacked = [*self.vals, *(a.detach().reshape(()).to(torch.float64) for a in tensor_args)]
            host = torch.stack(stacked).cpu().tolist()
            raw.update(zip(self.keys, host[: len(self.vals)]))
        args_host = iter(host[len(self.vals) :])
        out: dict[str, float] = {}
        for key, (how, args) in self.decl.items():  # tensor arguments in the order they were stacked
            out[key] = how(raw[key], *(next(args_host) if isinstance(a, Tensor) else a for a in args))
        return out

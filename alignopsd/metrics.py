"""The m2/* and episode/* diagnostics accumulator of Mechanism 2 (ALGORITHM.md §4.3)."""

from __future__ import annotations

import torch
from torch import Tensor

from alignopsd.samples import record_samples

__all__ = ["Metrics"]


class Metrics:
    """Collects 0-d tensors and Python numbers; one device->host transfer at the end."""

    def __init__(self, device) -> None:
        self.device = device
        self.keys: list[str] = []
        self.vals: list[Tensor] = []
        self.floats: dict[str, float] = {}

    def put(self, key: str, value) -> None:
        if isinstance(value, Tensor):
            self.keys.append(key)
            self.vals.append(value.detach().reshape(()).to(torch.float64))
        else:
            self.floats[key] = float(value)

    def rate(self, key: str, flags: Tensor) -> None:
        self.put(key, flags.double().mean() if flags.numel() else 0.0)

    def dist(self, prefix: str, x: Tensor, quantiles: tuple[float, ...] = (0.95,), names: tuple[str, ...] = ()):
        names = names or tuple(f"p{round(q * 100)}" for q in quantiles)
        keys = ["mean", "std", "min", "max", *names]
        record_samples(prefix, x, 0)
        if x.numel() == 0:
            for k in keys:
                self.floats[f"{prefix}_{k}"] = 0.0
            return
        x = x.double()
        qs = torch.quantile(x, torch.tensor(quantiles, dtype=torch.float64, device=x.device)) if quantiles else None
        stats = [x.mean(), x.std(correction=0), x.min(), x.max()] + ([qs[i] for i in range(len(quantiles))])
        for k, v in zip(keys, stats):
            self.put(f"{prefix}_{k}", v)

    def dists(self, named: dict[str, Tensor], quantile: float = 0.95) -> None:
        """mean/std/min/max/p95 of several equally long non-empty distributions in one batched pass."""
        keys = list(named)
        for k in keys:
            record_samples(k, named[k], 0)
        x = torch.stack([named[k].double() for k in keys])
        q = torch.quantile(x, quantile, dim=1)
        stats = torch.stack([x.mean(1), x.std(1, correction=0), x.amin(1), x.amax(1), q], 1)
        for i, k in enumerate(keys):
            for j, name in enumerate(("mean", "std", "min", "max", f"p{round(quantile * 100)}")):
                self.keys.append(f"{k}_{name}")
                self.vals.append(stats[i, j])

    def corr(self, key: str, x: Tensor, y: Tensor) -> None:
        if x.numel() < 2:
            self.put(key, 0.0)
            return
        x = x.double() - x.double().mean()
        y = y.double() - y.double().mean()
        den = torch.sqrt((x * x).sum() * (y * y).sum())
        self.put(key, torch.where(den > 0, (x * y).sum() / den.clamp_min(1e-300), torch.zeros_like(den)))

    def result(self) -> dict[str, float]:
        out = dict(self.floats)
        if self.vals:
            out.update(zip(self.keys, torch.stack(self.vals).cpu().tolist()))
        return out

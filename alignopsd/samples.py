"""Opt-in record of the values behind distribution metrics (percentiles, stds).

A metric such as ``m2/turn_weight_p95`` cannot be combined from the values two data-parallel shares report: the
whole batch's percentile needs the values themselves. Inside :func:`recording_samples` every distribution the
diagnostics describe (:func:`alignopsd.diagnostics.describe`, ``Metrics.dist`` / ``Metrics.dists``) is appended
to the yielded list as ``(name, values, ddof)`` (``name`` as the producer knows it: a full key prefix for
``Metrics``, the bare name for ``describe``; ``ddof``: the producer's std convention). Outside it nothing is
kept and nothing is copied.

:func:`record_samples` returns a :class:`SampleRef` (None outside a recording) that the producer attaches to the
percentile and std metrics it declares (``alignopsd.reduction``): the values travel with those metrics when a
rank sends them to the others (pickled once per distribution, as a list of finite float64 values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["SampleRef", "recording_samples", "record_samples"]

_ACTIVE: ContextVar[list | None] = ContextVar("alignopsd_samples", default=None)


@contextlib.contextmanager
def recording_samples() -> Iterator[list[tuple[str, Any, int]]]:
    """Collect ``(name, values, ddof)`` of every described distribution within the block."""
    records: list[tuple[str, Any, int]] = []
    token = _ACTIVE.set(records)
    try:
        yield records
    finally:
        _ACTIVE.reset(token)


class SampleRef:
    """The values behind one described distribution (kept as given until :meth:`values` is first asked)."""

    __slots__ = ("_raw", "_list")

    def __init__(self, raw: Any) -> None:
        self._raw, self._list = raw, None

    def values(self) -> list[float]:
        """The finite values as float64 Python floats (one host transfer, cached)."""
        if self._list is None:
            import torch

            v = torch.as_tensor(self._raw).detach().reshape(-1).to("cpu", torch.float64)
            self._list, self._raw = v[torch.isfinite(v)].tolist(), None
        return self._list

    def __reduce__(self):
        return (_from_list, (self.values(),))


def _from_list(values: list[float]) -> SampleRef:
    ref = SampleRef(None)
    ref._list = values
    return ref


def record_samples(name: str, values: Any, ddof: int) -> SampleRef | None:
    """Append ``values`` (a tensor or array, kept as given: no copy, no host transfer) when recording; the
    handle the producer attaches to its declared percentiles and stds (None when not recording)."""
    records = _ACTIVE.get()
    if records is None:
        return None
    ref = SampleRef(values)
    records.append((name, values, int(ddof)))
    return ref

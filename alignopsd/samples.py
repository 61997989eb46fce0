"""Opt-in record of the values behind distribution metrics (percentiles, stds).

A metric such as ``m2/turn_weight_p95`` cannot be combined from the values two data-parallel shares report: the
whole batch's percentile needs the values themselves. Inside :func:`recording_samples` every distribution the
diagnostics describe (:func:`alignopsd.diagnostics.describe`, ``Metrics.dist`` / ``Metrics.dists``) is appended
to the yielded list as ``(name, values, ddof)`` (``name`` as the producer knows it: a full key prefix for
``Metrics``, the bare name for ``describe``; ``ddof``: the producer's std convention). Outside it nothing is
kept and nothing is copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["recording_samples", "record_samples"]

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


def record_samples(name: str, values: Any, ddof: int) -> None:
    """Append ``values`` (a tensor or array, kept as given: no copy, no host transfer) when recording."""
    records = _ACTIVE.get()
    if records is not None:
        records.append((name, values, int(ddof)))

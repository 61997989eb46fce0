"""The process's resident memory: now, and its peak since a point the caller chooses.

Linux keeps a process's peak resident set size (``VmHWM`` in ``/proc/self/status``) and lets the process reset it to
its current size (``5`` written to ``/proc/self/clear_refs``), so a peak can be read per stage or per phase of a step
instead of once for the whole process. Where that file cannot be written (an older kernel, a sandbox), the peak is the
process's since its start and :func:`reset_peak` says so by returning False. Elsewhere (no ``/proc``) the peak comes
from ``getrusage`` (kilobytes on Linux, bytes on macOS) and the current size is not known (None).

:class:`PeakScope` is the peak while a block runs; scopes nest (a step's phases inside a pipeline's stage).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

GIB = float(1 << 30)
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int | None:
    """The process's resident set size now (None where the system does not say)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """The process's peak resident set size since its start or the last :func:`reset_peak` that took effect."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def reset_peak() -> bool:
    """Reset the process's peak resident set size to its current size; False where the system does not allow it
    (the peak then keeps counting from the process's start)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class PeakScope:
    """The peak resident memory of the process while a block runs (``with PeakScope() as scope: ...``;
    :attr:`peak` bytes, also while it runs). Scopes nest: a scope resets the process's peak when it starts, after
    crediting the peak so far to every scope still open, so each open scope's peak stays exact (a step's phases inside
    a pipeline's stage, say)."""

    def __init__(self) -> None:
        self.peak = 0

    def __enter__(self) -> PeakScope:
        _credit(peak_rss_bytes())
        reset_peak()
        _OPEN.append(self)
        self.peak = peak_rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        _credit(peak_rss_bytes())
        _OPEN.remove(self)

    def read(self) -> int:
        """The peak so far (while the block runs)."""
        _credit(peak_rss_bytes())
        return self.peak


_OPEN: list[PeakScope] = []  # the scopes open in this process, outermost first (the process has one peak)


def _credit(peak: int) -> None:
    for scope in _OPEN:
        scope.peak = max(scope.peak, peak)


def gib(n: int | float | None) -> str:
    """``12.3 GiB`` (``-`` when unknown)."""
    return "-" if n is None else f"{n / GIB:.1f} GiB"


class StageLog:
    """The seconds and the peak resident memory of a pipeline's stages, in the order they ran (``with
    log.stage("warm start"): ...``); what the end-of-run table prints."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def stage(self, label: str) -> Iterator[None]:
        t0 = time.perf_counter()
        with PeakScope() as mem:
            try:
                yield
            finally:
                self.seconds[label] = time.perf_counter() - t0
        self.peaks[label] = mem.peak

    def peak(self) -> int:
        """The largest peak of the stages so far."""
        return max(self.peaks.values(), default=0)

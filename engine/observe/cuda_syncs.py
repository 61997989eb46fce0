"""Host synchronisations counted on a CUDA device, per profiler phase (engine/observe/profiler.py).

With ``torch.cuda.set_sync_debug_mode("warn")`` torch warns (``UserWarning: called a synchronizing CUDA
operation``) at every operation that makes the host wait for the device: copies to the host (``.item()``,
``.tolist()``, ``.cpu()``), ops whose output size depends on the data (``nonzero``, boolean-mask indexing),
stream synchronisations. :class:`CudaSyncCounter` turns that mode on for its block and counts those warnings, each
booked to the profiler's current phase (:func:`profiler.current_phase`), as the test suite's fake CUDA device counts
its host syncs on the CPU (tests/engine/fake_cuda.py); both register with the profiler the same way, so a step's
``host_syncs/<phase>`` metrics and ``alignopsd profile``'s table read either one alike. Warnings raised inside
``torch.cuda.synchronize`` (the profiler's own phase edges) are booked as ``"synchronize"``, which the profiler
leaves out. The sync warnings are counted, not shown; every other warning passes through unchanged.

Limits: a sync made by the autograd engine's device thread during ``backward`` warns there, not in the Python
thread, and is not counted; the mode is process-wide for the block's duration.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from alignopsd.engine.observe import profiler

SYNC_MESSAGE = "called a synchronizing CUDA operation"


class CudaSyncCounter(profiler.SyncCounts):
    """``with CudaSyncCounter() as c:`` counts host syncs per (phase, kind) in ``c.syncs`` (kinds: ``"sync"``,
    ``"synchronize"``); see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._in_synchronize = 0
        self._saved: dict[str, Any] = {}

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, UserWarning) and str(message).startswith(SYNC_MESSAGE):
            self.note_sync("synchronize" if self._in_synchronize else "sync")
            return
        self._saved["showwarning"](message, category, filename, lineno, file, line)

    def _synchronize(self, *args: Any, **kwargs: Any) -> None:
        self._in_synchronize += 1
        try:
            self._saved["synchronize"](*args, **kwargs)
        finally:
            self._in_synchronize -= 1

    def __enter__(self) -> CudaSyncCounter:
        catch = warnings.catch_warnings()  # restores the filters and ``showwarning`` on exit
        catch.__enter__()
        self._saved = {
            "catch": catch,
            "mode": torch.cuda.get_sync_debug_mode(),
            "showwarning": warnings.showwarning,
            "synchronize": torch.cuda.synchronize,
        }
        warnings.filterwarnings("always", message=SYNC_MESSAGE, category=UserWarning)  # every one, not once a line
        warnings.showwarning = self._showwarning
        torch.cuda.synchronize = self._synchronize
        torch.cuda.set_sync_debug_mode("warn")
        profiler.register_sync_counter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        profiler.unregister_sync_counter(self)
        torch.cuda.set_sync_debug_mode(self._saved["mode"])
        torch.cuda.synchronize = self._saved["synchronize"]
        self._saved["catch"].__exit__(*exc)

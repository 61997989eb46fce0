"""Measurement helpers shared by the benchmarks: interleaved median times and allocation peaks.

Peak memory on CPU is the running sum of the tensor allocation/free events of torch's profiler during one call
(the process's resident set reads ~0 inside a long-lived report process); on CUDA it is the allocator's peak
above the allocation at the call's start.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_mb(fn, device: str = "cpu") -> tuple[float, object]:
    """Allocation peak (MiB) of one call of ``fn`` above the allocation at its start (see module docstring)."""
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - start) / 2**20, out
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        out = fn()
    return profile_peak_mb(prof), out


def profile_peak_mb(prof) -> float:
    """Peak (MiB) of the running sum of a finished CPU profile's tensor allocation/free events."""
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    ]
    events.sort(key=lambda e: e.start_ns())
    running, peak = 0, 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak / 2**20


def median_times(ours, base, reps: int, device: str = "cpu", warmup: bool = True) -> tuple[float, float]:
    """Median wall time (ms) of ``reps`` interleaved calls each, after one warm-up call each (if ``warmup``)."""
    t_o, t_b = [], []
    for fn in (ours, base) if warmup else ():
        fn()
    _sync(device)
    for _ in range(reps):
        for fn, acc in ((ours, t_o), (base, t_b)):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            acc.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t_o), statistics.median(t_b)

"""Host syncs counted on CUDA with torch's sync debug mode (engine/observe/cuda_syncs.py), driven through the fake-CUDA
mode, which warns at each host sync in "warn" mode as a GPU does (its own counts are the reference)."""

from __future__ import annotations

import warnings

import pytest
import torch
from alignopsd.engine.observe.cuda_syncs import CudaSyncCounter
from alignopsd.engine.observe.profiler import StepProfiler, format_table, summarize
from fake_cuda import FakeCuda


def _step(prof: StepProfiler, x: torch.Tensor) -> dict:
    prof.start_step()
    with prof.phase("update"):
        x.sum().item()
        x.tolist()
    with prof.phase("rectify"):
        x.cpu()
        x[x > 0]
    x.max().item()  # outside every phase
    return prof.end_step()


def test_sync_debug_warnings_are_counted_per_phase_like_the_fake_counts():
    prof = StepProfiler()
    with FakeCuda() as fc:
        x = torch.randn(5, device="cuda")
        assert torch.cuda.get_sync_debug_mode() == 0
        sync_fn = torch.cuda.synchronize
        with CudaSyncCounter() as c:
            assert torch.cuda.get_sync_debug_mode() == 1
            m = [_step(prof, x) for _ in range(2)][-1]
            torch.cuda.synchronize()  # the profiler's kind of sync: booked apart, left out
        assert torch.cuda.get_sync_debug_mode() == 0 and torch.cuda.synchronize is sync_fn
    assert c.syncs_by_phase(exclude=("synchronize",)) == fc.syncs_by_phase(exclude=("synchronize",))
    assert c.syncs_by_phase(exclude=("synchronize",)) == {"update": 4, "rectify": 4, "(outside a phase)": 2}
    assert c.syncs[("(outside a phase)", "synchronize")] == 0  # torch.cuda.synchronize does not warn
    assert m["host_syncs/update"] == 2 and m["host_syncs/rectify"] == 2 and m["host_syncs/other"] == 1
    s = summarize(prof.history, prof.step_seconds, syncs=prof.sync_history)
    assert s["host_syncs"] == {"update": 2, "rectify": 2, "(outside a phase)": 1}
    assert "host syncs per step (host waits for the device): 5" in format_table(s)


def test_sync_warnings_inside_synchronize_are_booked_apart_and_other_warnings_pass(monkeypatch):
    """On a device whose ``torch.cuda.synchronize`` warns too, the profiler's edge syncs stay out of the counts; a
    warning that is not a sync warning reaches the usual handler; no sync warning is shown."""
    with FakeCuda():
        real_sync = torch.cuda.synchronize

        def warning_sync(*a, **k):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
            real_sync(*a, **k)

        monkeypatch.setattr(torch.cuda, "synchronize", warning_sync)
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            with CudaSyncCounter() as c:
                torch.cuda.synchronize()
                torch.ones(2, device="cuda").sum().item()
                warnings.warn("something else", UserWarning, stacklevel=1)
    assert c.syncs[("(outside a phase)", "synchronize")] == 1 and c.syncs[("(outside a phase)", "sync")] == 1
    assert [str(w.message) for w in shown] == ["something else"]


def test_error_mode_raises_at_a_host_sync():
    with FakeCuda():
        x = torch.ones(3, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
                x.sum().item()
            (x * 2).exp()  # no sync: no error
        finally:
            torch.cuda.set_sync_debug_mode("default")

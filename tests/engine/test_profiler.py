"""Step profiler: phase accounting, summary JSON, overhead over GRPO, table formatting."""

from __future__ import annotations

import json
import time

import pytest
from alignopsd.engine.profiler import (
    ALIGNMENT_PHASES,
    PHASES,
    StepProfiler,
    format_side_by_side,
    format_table,
    summarize,
    write_json,
)


def test_phase_accounting_and_summary(tmp_path):
    prof = StepProfiler()
    for _ in range(2):
        prof.start_step()
        with prof.phase("rollout_generation"):
            time.sleep(0.03)
        prof.move("rollout_generation", "environment", 0.01)
        with prof.phase("teacher_generation"):
            time.sleep(0.02)
        with prof.phase("update"):
            time.sleep(0.01)
        m = prof.end_step()
        assert m["time/environment"] == pytest.approx(0.01)
        assert m["time/step"] >= m["time/rollout_generation"] + m["time/teacher_generation"]
    s = summarize(prof.history, prof.step_seconds)
    assert set(s["phases"]) == set(PHASES) and s["steps"] == 2
    assert s["alignment_seconds"] == pytest.approx(sum(s["phases"][k] for k in ALIGNMENT_PHASES))
    assert s["overhead_vs_grpo"] == pytest.approx(s["alignment_seconds"] / (s["step_seconds"] - s["alignment_seconds"]))
    write_json(s, tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert set(data) == {"phases", "step_seconds", "alignment_seconds", "overhead_vs_grpo"}
    table = format_table(s, "AlignOPSD")
    assert "teacher generation *" in table and "overhead over GRPO" in table
    side = format_side_by_side({"grpo": s, "alignopsd": s})
    assert side.count("\n") == len(PHASES) + 3


def test_exact_overhead_numbers():
    hist = [{k: 0.0 for k in PHASES} | {"rollout_generation": 3.0, "teacher_generation": 1.0, "m2": 0.5}]
    s = summarize(hist, [5.0])
    assert s["alignment_seconds"] == 1.5 and s["overhead_vs_grpo"] == pytest.approx(1.5 / 3.5)


def test_bad_phase_name_and_empty_history():
    prof = StepProfiler()
    prof.start_step()
    with pytest.raises(ValueError, match="phase"):
        with prof.phase("nope"):
            pass
    with pytest.raises(ValueError, match="phase"):
        prof.add("nope", 1.0)
    with pytest.raises(ValueError, match="history"):
        summarize([], [])

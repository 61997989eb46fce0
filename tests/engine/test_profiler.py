"""Step profiler: phase accounting, summary JSON, overhead over GRPO, table formatting."""

from __future__ import annotations

import json
import time

import pytest
from alignopsd.engine.observe.profiler import (
    ALIGNMENT_PHASES,
    PHASES,
    StepProfiler,
    format_side_by_side,
    format_table,
    phase_label,
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


def test_phase_label_marks_only_alignment_phases():
    assert phase_label("teacher_forcing") == "teacher forcing"
    assert phase_label("teacher_forcing", mark=True) == "teacher forcing *"
    assert phase_label("old_logprob", mark=True) == "old log-prob"
    assert [k for k in PHASES if phase_label(k, mark=True).endswith(" *")] == list(ALIGNMENT_PHASES)


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


def test_counts_are_averaged_over_the_kept_steps(tmp_path):
    hist = [{k: 0.0 for k in PHASES} | {"update": v} for v in (5.0, 1.0, 3.0)]
    counts = [{"batch/rows": 99.0}, {"batch/rows": 10.0, "rollout/response_length_mean": 40.0}, {"batch/rows": 20.0}]
    s = summarize(hist, [5.0, 1.0, 3.0], skip=1, counts=counts)  # step 0 (the warm-up) is out of both
    assert s["phases"]["update"] == 2.0 and s["counts"] == {"batch/rows": 15.0, "rollout/response_length_mean": 40.0}
    write_json(s, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["counts"] == s["counts"]
    assert "per step: batch/rows 15" in format_table(s)
    with pytest.raises(ValueError, match="counts: 2 step"):
        summarize(hist, [5.0, 1.0, 3.0], counts=counts[:2])


def test_side_by_side_ratio_and_count_rows():
    base = {k: 0.0 for k in PHASES}
    a = summarize([base | {"update": 1.0, "rollout_generation": 2.0}], [4.0], counts=[{"batch/rows": 8.0}])
    b = summarize([base | {"update": 3.0}], [5.0], counts=[{"batch/rows": 8.0, "batch/turns": 6.0}])
    lines = format_side_by_side({"HF": a, "TP2": b}, ratio=True).splitlines()
    assert lines[0].endswith("| TP2 / HF |")
    assert lines[1].count("---:") == 5
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in lines[2:]}
    assert rows["PPO update"].endswith("| 3.00 |") and rows["rollout generation"].endswith("| 0.00 |")
    assert rows["reference log-prob"].endswith("| – |")  # 0 s on the first run: no ratio
    assert rows["**step**"].endswith("| 1.25 |")
    assert rows["batch/rows"].endswith("| 1.00 |") and "| – | " in rows["batch/turns"]
    assert rows["batch/turns"].endswith("| – |")
    with pytest.raises(ValueError, match="exactly two runs"):
        format_side_by_side({"a": a, "b": b, "c": a}, ratio=True)


def test_phase_table_formatter(tmp_path, capsys):
    from bench.phase_table import main

    base = {k: 0.0 for k in PHASES}
    for name, upd in (("a", 1.0), ("b", 2.0)):
        write_json(summarize([base | {"update": upd}], [upd], counts=[{"batch/rows": 4.0}]), tmp_path / f"{name}.json")
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--names", "HF,Megatron TP=2"]) == 0
    out = capsys.readouterr().out
    assert "| Megatron TP=2 / HF |" in out and "| PPO update | 1.000 | 100.0% | 2.000 | 100.0% | 2.00 |" in out
    (tmp_path / "bad.json").write_text(json.dumps({"grpo": {}}))
    with pytest.raises(ValueError, match="bad.json: not a single-estimator profile summary"):
        main([str(tmp_path / "a.json"), str(tmp_path / "bad.json")])
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--names", "HF"]) == 2

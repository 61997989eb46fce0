"""Metrics logger (JSONL, TensorBoard, progress line) and the end-of-run report."""

from __future__ import annotations

import io
import json
import math

from alignopsd.engine.observe.metrics import MetricsLogger, flatten, progress_line, read_metrics
from alignopsd.engine.observe.report import write_report
from alignopsd.engine.observe.sinks import TensorBoardSink


def _fake_step(s: int) -> dict:
    return {
        "episode/reward_mean": 0.1 * s,
        "episode/success_rate": 0.05 * s,
        "episode/valid_action_rate": 0.5,
        "episode/success/pick": 0.2,
        "actor/loss": -0.01 * s,
        "m1/diagonal_gap/mean": -0.2,
        "m1/corrected_gap/mean": -0.1,
        "m1/off_turn_match_weight": 0.4,
        "m2/segment_length_mean": 2.5,
        "time/step": 1.0,
        "time/rollout_generation": 0.5,
        "time/teacher_generation": 0.2,
        "time/update": 0.3,
        "bad": float("nan"),
        "nested": {"x": 1},
        "text": "ignored",
    }


def test_flatten_and_progress_line():
    flat = flatten({"a": {"b": 1, "c": float("inf")}, "d": True, "s": "x"})
    assert flat == {"a/b": 1.0, "a/c": None, "d": 1.0}
    line = progress_line(3, 10, {"episode/reward_mean": 1.5, "episode/success_rate": 0.25, "time/step": 2.0})
    assert line.startswith("step    3/10") and "reward 1.500" in line and "success 0.250" in line and "2.0s" in line


def test_logger_jsonl_tensorboard_and_resume(tmp_path):
    out = io.StringIO()
    lg = MetricsLogger(tmp_path, total_steps=4, sinks=[TensorBoardSink(tmp_path / "tb")], stream=out)
    for s in (1, 2, 3):
        lg.log(s, _fake_step(s))
    lg.log(3, {"episode/success_rate": 0.5}, kind="val")
    lg.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["bad"] is None and recs[0]["nested/x"] == 1.0 and "text" not in recs[0]
    assert read_metrics(tmp_path / "metrics.jsonl", "val")[0]["episode/success_rate"] == 0.5
    assert len(out.getvalue().strip().splitlines()) == 3
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    # the logger appends (the trainer sets an earlier run's records aside first: engine/run/history.py)
    lg2 = MetricsLogger(tmp_path, total_steps=4, stream=io.StringIO())
    lg2.log(4, _fake_step(4))
    lg2.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_rank_nonzero_writes_nothing(tmp_path):
    lg = MetricsLogger(tmp_path / "r1", total_steps=1, rank=1, stream=io.StringIO())
    lg.log(1, _fake_step(1))
    assert not (tmp_path / "r1").exists()


def test_report_writes_markdown_and_plots(tmp_path):
    lg = MetricsLogger(tmp_path, total_steps=3, stream=io.StringIO())
    for s in (1, 2, 3):
        lg.log(s, _fake_step(s))
    lg.log(3, {"episode/success_rate": 0.5, "episode/reward_mean": 2.0}, kind="val")
    lg.close()
    (tmp_path / "span_lengths.json").write_text(json.dumps([2, 2, 3, 4, 2]))
    path = write_report(tmp_path, title="test run")
    md = path.read_text()
    for png in ("reward_success.png", "gap.png", "span_lengths.png", "phase_costs.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
        assert png in md
    assert "| success rate | 0.05 | 0.15 | 0.5 |" in md
    assert "off-turn match weight" in md and "success: pick" in md
    # alignment overhead: teacher 0.2 of a 1.0 s step -> 0.2 / 0.8 = 25%
    assert "Alignment overhead over GRPO: 25.0%" in md
    assert math.isfinite(float(md.count("|")))

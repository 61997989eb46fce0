"""The PPO micro-batch benchmark runs on the tiny model and both of its sides leave the same gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_bench_update_quick_on_tiny_model():
    from bench.bench_update import run

    torch.set_num_threads(1)
    r = run("quick", model_name="tiny", reps=1)
    assert r["ours_ms"] > 0 and r["base_ms"] > 0 and r["ours_peak_mb"] > 0 and r["base_peak_mb"] > 0
    assert r["scored_tokens"] > 0
    assert float(r["max_grad_diff"]) <= 1e-5 * max(1.0, float(r["max_grad"]))
    assert float(r["max_grad"]) > 0  # the comparison is not vacuous

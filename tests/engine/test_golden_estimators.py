"""Golden traces of every estimator and ablation (DESIGN.md example 8): 3 seeded steps of tiny.yaml each.

A change that moves the loss, reward, gradient norm or advantage scale of any estimator is seen. Regenerate only
when a number changes on purpose, and say in that commit which numbers moved and why:
``python tests/engine/regen_golden.py --estimators``.
"""

from __future__ import annotations

import json
from pathlib import Path

import learn_helpers as lh
import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden_estimators.json"
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in lh.ESTIMATOR_CASES])
def test_golden_estimator_trace(case, tmp_path):
    expect = json.loads(GOLDEN.read_text())
    overrides = dict(lh.ESTIMATOR_CASES)[case]
    assert expect["cases"][case]["overrides"] == overrides
    _, recs = lh.run_tiny(tmp_path, overrides, STEPS)
    got = lh.trace_of(recs)
    want = expect["cases"][case]["steps"]
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), (case, g["step"], sorted(set(g) ^ set(w)))
        for k, v in w.items():
            if k == "episode/reward_mean":
                assert g[k] == pytest.approx(v, abs=1e-6), (case, g["step"], k)
            else:  # rel 2e-3: fp32 summation-order changes move these ~1e-4; algorithm changes by percents
                assert g[k] == pytest.approx(v, rel=2e-3, abs=1e-6), (case, g["step"], k)

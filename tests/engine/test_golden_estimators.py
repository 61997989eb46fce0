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
import torch

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden_estimators.json"
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in lh.ESTIMATOR_CASES])
def test_golden_estimator_trace(case, tmp_path):
    expect = json.loads(GOLDEN.read_text())
    overrides = dict(lh.ESTIMATOR_CASES)[case]
    assert expect["cases"][case]["overrides"] == overrides
    tr, recs = lh.run_tiny(tmp_path, overrides, STEPS)
    _check_trained_through_the_step(tr, recs)
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


def _check_trained_through_the_step(tr, recs) -> None:
    """Every phase the estimator declares ran on every updated step, optimizer steps were taken and the policy's
    weights moved away from the tiny model's initial weights."""
    from alignopsd.engine.models.loading import load_causal_lm

    phases = tr.parts.estimator.phases(tr.cfg.algorithm)
    declared = ["rollout_generation", "old_logprob", "update"]
    declared += ["reference"] if phases.ref else []
    declared += ["teacher_forcing"] if phases.teacher_diag or phases.alignment else []
    declared += ["teacher_generation", "encoding", "m1_selection", "rectify"] if phases.alignment else []
    declared += ["m2"] if phases.mechanism2 else ["advantage"]
    updated = [r for r in recs if not r.get("update/skipped")]
    assert len(updated) >= 2, [r.get("update/skipped") for r in recs]
    for r in updated:
        missing = [p for p in declared if not r.get(f"time/{p}", 0.0) > 0]
        assert not missing, (r["step"], missing)
        assert r["update/optimizer_steps"] >= 1 and r["update/skipped_optimizer_steps"] == 0
    if not phases.alignment:  # a phase the estimator does not declare never runs
        assert all(r.get("time/teacher_generation", 0.0) == 0 for r in recs)
    start = load_causal_lm("tiny").state_dict()
    now = tr.parts.policy.model.state_dict()
    assert any(not torch.equal(start[k], now[k].to(start[k].dtype)) for k in start)

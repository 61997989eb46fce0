"""Data-parallel metric reduction: two ranks holding skewed halves of a batch report what one rank holding the
whole batch reports, for m1/ gap (also paired), m2/ distribution, rate, RMS and count keys
(engine/parallel/metric_reduce.py);
the percentiles come from the values the producers recorded (alignopsd.samples)."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.parallel.collectives import reduce_metrics
from alignopsd.engine.parallel.metric_reduce import merge_samples, metric_kind, samples_of

from alignopsd.diagnostics import describe
from alignopsd.metrics import Metrics
from alignopsd.samples import recording_samples


def _share(gaps, spans, weights, valid, traj_len, traj_adv):
    """One rank's metrics, computed by the producers the runs use, and the samples the step derives from what
    they recorded (``samples_of``)."""
    with recording_samples() as records:
        out = {f"m1/{k}": v for k, v in describe(gaps, "corrected_gap").items()}
        out.update({f"m1/paired/response/{k}": v for k, v in describe(gaps[::2], "corrected_gap").items()
                    if not k.endswith(("_count", "_min", "_max"))})  # fmt: skip
        out["m1/teacher_student_gap_mean"] = float(gaps.mean())
        out["m1/teacher_student_gap_std"] = float(torch.sqrt((gaps * gaps).mean()))
        out["m1/valid_match_rate"] = float(valid.double().mean())
        out["batch/turns"] = float(weights.numel())
        mx = Metrics("cpu")
        mx.dist("m2/segment_length", spans.double(), ())
        mx.put("m2/segment_count", float(spans.numel()))
        mx.dists({"m2/turn_weight": weights})
        mx.put("episode/unique_trajectory_count", float(traj_len.numel()))
        mx.put("episode/trajectory_length_max", traj_len.double().max())
        mx.put("m2/trajectory_advantage_mean", traj_adv.mean())
        mx.put("m2/trajectory_advantage_std", traj_adv.std(correction=0))
        out.update(mx.result())
    return out, samples_of(out, records)


def test_skewed_halves_reduce_to_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    n_tok, n_turn, n_traj = 200, 40, 12
    gaps = torch.randn(n_tok, generator=g, dtype=torch.float64) * 2 + 0.3
    weights = torch.rand(n_turn, generator=g, dtype=torch.float64) * 3
    valid = torch.rand(n_turn, generator=g) > 0.3
    spans = torch.randint(2, 9, (15,), generator=g)
    traj_len = torch.randint(1, 10, (n_traj,), generator=g)
    traj_adv = torch.randn(n_traj, generator=g, dtype=torch.float64)
    whole, _ = _share(gaps, spans, weights, valid, traj_len, traj_adv)
    cut = {"tok": 24, "turn": 7, "span": 3, "traj": 2}  # rank 0 holds a small share, rank 1 the rest
    halves = []
    for lo in (True, False):

        def pick(x, c, lo=lo):
            return x[: cut[c]] if lo else x[cut[c] :]

        halves.append(_share(pick(gaps, "tok"), pick(spans, "span"), pick(weights, "turn"), pick(valid, "turn"),
                             pick(traj_len, "traj"), pick(traj_adv, "traj")))  # fmt: skip
    got = reduce_metrics([m for m, _ in halves], merge_samples([s for _, s in halves]))
    assert "metrics/unreduced" not in got
    assert set(got) == set(whole)
    for k, v in whole.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (k, metric_kind(k), got[k], v)
    # what an unweighted mean over ranks gave: visibly wrong on these keys
    for k in (
        "m1/corrected_gap_p50",
        "m1/paired/response/corrected_gap_p90",
        "m2/segment_length_min",
        "m2/turn_weight_std",
        "m1/valid_match_rate",
        "m1/teacher_student_gap_std",
    ):
        plain = sum(m[k] for m, _ in halves) / 2
        assert plain != pytest.approx(whole[k], rel=1e-6), k


def test_kinds_and_a_percentile_without_samples():
    assert [metric_kind(k) for k in ("episode/count", "batch/rows", "m2/segment_length_min", "rollout_is/max",
                                     "m1/corrected_gap_p90", "m2/turn_gap_std", "actor/lr", "episode/reward_mean",
                                     "time/phase/update")] == [
        "sum", "sum", "min", "max", "quantile", "std", "same", "mean", "max"]  # fmt: skip
    a = {"m2/segment_length_min": 2.0, "m2/turn_gap_p95": 1.0, "episode/count": 10.0, "episode/reward_mean": 1.0}
    b = {"m2/segment_length_min": 4.0, "m2/turn_gap_p95": 3.0, "episode/count": 30.0, "episode/reward_mean": 0.0}
    got = reduce_metrics([a, b])
    assert got["m2/segment_length_min"] == 2.0 and got["episode/count"] == 40.0
    assert got["episode/reward_mean"] == pytest.approx(0.25)  # 10 episodes at 1, 30 at 0
    assert "m2/turn_gap_p95" not in got and got["metrics/unreduced"] == 1.0  # never an average of percentiles
    assert reduce_metrics([a]) == a  # one rank: its own values

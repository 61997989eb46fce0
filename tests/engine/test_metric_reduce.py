"""Data-parallel metric reduction (engine/parallel/metric_reduce.py) by the declaration each value carries
(alignopsd.reduction): two ranks holding skewed, uneven or empty shares of a batch report, once reduced, what one
rank holding the whole batch reports. Every share goes through the producers the runs use and through a pickle
round trip (what ``all_gather_object`` does), so the declarations and the samples behind the percentiles travel
the way they do in a run."""

from __future__ import annotations

import pickle

import pytest
import torch
from alignopsd.engine.generation.base import prefill_delta
from alignopsd.engine.observe.profiler import StepProfiler
from alignopsd.engine.parallel.collectives import reduce_metrics
from alignopsd.engine.parallel.metric_reduce import UndeclaredMetricError
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.episodes import episode_metrics

from alignopsd.diagnostics import describe, paired_sign_flips
from alignopsd.metrics import Metrics
from alignopsd.reduction import Reduce, Stat, summed, weighted_mean
from alignopsd.rollout_correction import rollout_is_weights, rollout_mismatch_metrics
from alignopsd.samples import recording_samples


def _over_ranks(shares: list[dict], *, strict: bool = True) -> dict[str, float]:
    """The shares as another rank receives them (pickled), reduced."""
    return reduce_metrics([pickle.loads(pickle.dumps(s)) for s in shares], strict=strict)


def _assert_same(got: dict, whole: dict, skip: tuple[str, ...] = (), rel: float = 1e-9) -> None:
    assert "metrics/unreduced" not in got and "metrics/undeclared" not in got
    assert set(got) == set(whole)
    for k, v in whole.items():
        if k not in skip:
            assert got[k] == pytest.approx(v, rel=rel, abs=1e-12), (k, whole[k].how, got[k], v)


def _m_share(gaps, spans, weights, valid, traj_len, traj_adv):
    """One rank's m1/m2/episode metrics from the core producers, recorded as a data-parallel step records them."""
    with recording_samples():
        out = {f"m1/{k}": v for k, v in describe(gaps, "corrected_gap").items()}
        out.update({f"m1/paired/response/{k}": v for k, v in describe(gaps[::2], "corrected_gap").items()
                    if not k.endswith(("_count", "_min", "_max"))})  # fmt: skip
        mx = Metrics("cpu")
        mx.dist("m2/segment_length", spans.double(), ())
        mx.put("m2/segment_count", float(spans.numel()), summed)
        mx.dists({"m2/turn_weight": weights})
        mx.rate("m1/valid_match_rate", valid)
        mx.corr("m2/turn_weight_corr_score", weights, weights.square() - valid.double())
        mx.put("episode/unique_trajectory_count", float(traj_len.numel()), summed)
        mx.dist("episode/trajectory_length", traj_len.double(), (0.5,))
        mx.put("m2/trajectory_advantage_mean", traj_adv.mean(), weighted_mean, traj_adv.numel())
        out.update(mx.result())
    return out


def test_skewed_halves_reduce_to_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    gaps = torch.randn(200, generator=g, dtype=torch.float64) * 2 + 0.3
    weights = torch.rand(40, generator=g, dtype=torch.float64) * 3
    valid = torch.rand(40, generator=g) > 0.3
    spans = torch.randint(2, 9, (15,), generator=g)
    traj_len = torch.randint(1, 10, (12,), generator=g)
    traj_adv = torch.randn(12, generator=g, dtype=torch.float64)
    data = (gaps, spans, weights, valid, traj_len, traj_adv)
    whole = _m_share(*data)
    cut = (24, 3, 7, 7, 2, 2)  # rank 0 holds a small share, rank 1 the rest
    halves = [_m_share(*(x[:c] for x, c in zip(data, cut))), _m_share(*(x[c:] for x, c in zip(data, cut)))]
    got = _over_ranks(halves)
    _assert_same(got, whole)
    # what an unweighted mean over ranks gave: visibly wrong on these keys
    for k in ("m1/corrected_gap_p50", "m1/paired/response/corrected_gap_p90", "m2/turn_weight_std",
              "m1/valid_match_rate", "m2/segment_length_std", "m2/turn_weight_corr_score"):  # fmt: skip
        assert sum(h[k] for h in halves) / 2 != pytest.approx(whole[k], rel=1e-6), k


def test_empty_population_on_a_rank_is_left_out_of_min_max_and_means():
    """Issue case: rank 0 with gaps [3, 5, 4] and an empty rank 1 log cross_gap_min 3.0, not 0.0."""
    vals = torch.tensor([3.0, 5.0, 4.0], dtype=torch.float64)
    shares = []
    for v in (vals, vals[:0]):
        with recording_samples():
            shares.append({f"m1/{k}": x for k, x in describe(v, "cross_gap").items()})
    with recording_samples():
        whole = {f"m1/{k}": x for k, x in describe(vals, "cross_gap").items()}
    got = _over_ranks(shares)
    _assert_same(got, whole)
    assert got["m1/cross_gap_min"] == 3.0 and got["m1/cross_gap_max"] == 5.0 and got["m1/cross_gap_mean"] == 4.0
    # Metrics.dist of an empty share: the same rule
    parts = []
    for v in (vals, vals[:0]):
        mx = Metrics("cpu")
        mx.dist("m2/normalized_jsd", v, (0.5,))
        mx.rate("m2/near_zero_jsd_rate", v < 3.5)
        with recording_samples():
            parts.append(mx.result())
    got = _over_ranks(parts)
    assert got["m2/normalized_jsd_min"] == 3.0 and got["m2/near_zero_jsd_rate"] == pytest.approx(1 / 3)


def _episodes(n_win: int, n: int, category: str, data_source: str, score: float | None) -> list[dict]:
    return [{"reward": float(i < n_win), "won": i < n_win, "steps": 1 + i % 3, "category": category,
             "data_source": data_source, "task_score": score} for i in range(n)]  # fmt: skip


def _batch(valid: list[bool], resp_len: list[int]) -> TurnBatch:
    m, L = len(valid), max(resp_len)
    mask = (torch.arange(L)[None, :] < torch.tensor(resp_len)[:, None]).long()
    return TurnBatch(
        task=torch.zeros(m, dtype=torch.long), rollout=torch.arange(m), turn=torch.zeros(m, dtype=torch.long),
        prompt_ids=torch.ones(m, 2, dtype=torch.long), prompt_mask=torch.ones(m, 2, dtype=torch.long),
        response_ids=torch.ones(m, L, dtype=torch.long), response_mask=mask,
        outcome=torch.zeros(m), action_valid=torch.tensor(valid),
    )  # fmt: skip


def test_per_category_rates_are_weighted_by_their_own_counts():
    """Issue case: 2/2 "pick" wins on one rank, 0/30 on the other: 2/32 = 0.0625, not 0.5; the same for the
    accuracy per data source, the task score over the scored episodes and the valid-action rate over the turns."""
    r0 = _episodes(2, 2, "pick", "text", 1.0) + _episodes(5, 20, "clean", "image", None)
    r1 = _episodes(0, 30, "pick", "image", 0.25) + _episodes(1, 2, "clean", "text", 0.5)
    turns = ([True] * 3, [4, 2, 1]), ([False] * 9 + [True], [1] * 9 + [6])
    whole = episode_metrics(r0 + r1, _batch(turns[0][0] + turns[1][0], turns[0][1] + turns[1][1]))
    got = _over_ranks([episode_metrics(r0, _batch(*turns[0])), episode_metrics(r1, _batch(*turns[1]))])
    _assert_same(got, whole, rel=1e-6)  # the batch's rates are float32 means
    assert got["episode/success/pick"] == pytest.approx(0.0625)
    assert got["episode/valid_action_rate"] == pytest.approx(4 / 13)  # over the turns, not the episodes or ranks
    assert got["rollout/response_length_max"] == 6.0


def test_counts_and_mismatch_reduce_as_the_whole_batch():
    """Issue case: ``*_forwards_unshared`` counts are summed like their ``*_forwards`` siblings (100 + 300 = 400,
    not 200); ``mismatch/tokens`` is summed and the other mismatch values are token- (or row-) weighted."""
    shares = [prefill_delta({}, {"prefill_token_forwards": 60, "prefill_token_forwards_unshared": 100}, "rollout/"),
              prefill_delta({"prefill_token_forwards_unshared": 50}, {"prefill_token_forwards": 90,
                            "prefill_token_forwards_unshared": 350}, "m1/teacher_")]  # fmt: skip
    shares[1].update(prefill_delta({}, {"prefill_token_forwards_unshared": 300}, "rollout/"))
    got = _over_ranks(shares)
    assert got["rollout/prefill_token_forwards_unshared"] == 400.0
    assert got["m1/teacher_prefill_token_forwards_unshared"] == 300.0 and got["rollout/prefill_token_forwards"] == 60

    g = torch.Generator().manual_seed(3)
    # an uneven split of 11 rows (9 and 2)
    ro = -torch.rand(11, 8, generator=g, dtype=torch.float64) * 2
    tr = ro + 0.3 * torch.randn(11, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(11, 8, generator=g) > 0.4
    mask[10] = False  # a row without tokens on rank 1
    whole = rollout_mismatch_metrics(ro, tr, mask)
    got = _over_ranks([rollout_mismatch_metrics(ro[:9], tr[:9], mask[:9]),
                       rollout_mismatch_metrics(ro[9:], tr[9:], mask[9:])])  # fmt: skip
    _assert_same(got, whole)
    assert got["mismatch/tokens"] == float(mask.sum())
    for level, mode in (("token", "mask"), ("sequence", "mask"), ("token", "truncate")):  # IS diagnostics
        kw = dict(level=level, mode=mode, threshold=1.5, lower=0.5)
        whole = rollout_is_weights(ro, tr, mask, **kw)[2]
        shares = [rollout_is_weights(ro[:9], tr[:9], mask[:9], **kw)[2],
                  rollout_is_weights(ro[9:], tr[9:], mask[9:], **kw)[2]]  # fmt: skip
        _assert_same(_over_ranks(shares), whole, rel=1e-6)  # (float32 fractions)


def test_paired_statistics_and_times():
    g = torch.Generator().manual_seed(5)
    d, c, r = (torch.randn(60, generator=g, dtype=torch.float64) for _ in range(3))
    with recording_samples():
        whole = paired_sign_flips(d, c, r, eps=0.1)
        shares = [
            paired_sign_flips(d[:11], c[:11], r[:11], eps=0.1),
            paired_sign_flips(d[11:], c[11:], r[11:], eps=0.1),
        ]
    _assert_same(_over_ranks(shares), whole)
    prof = [StepProfiler(), StepProfiler()]
    for p, s in zip(prof, (0.5, 2.0)):
        p.start_step()
        p.add("update", s)
    got = _over_ranks([p.end_step() for p in prof])
    assert got["time/update"] == 2.0  # the slowest rank


def test_declarations_are_read_not_names():
    """A key's name says nothing: the same name declared as a sum or as a mean reduces accordingly; a percentile
    whose samples a populated rank did not carry is left out (counted), never averaged."""
    a, b = {"x/p95": summed(3.0), "m": weighted_mean(1.0, 10)}, {"x/p95": summed(4.0), "m": weighted_mean(0.0, 30)}
    got = _over_ranks([a, b])
    assert got == {"x/p95": 7.0, "m": 0.25}
    q = [Stat(1.0, Reduce.QUANTILE, count=3, q=0.5), Stat(2.0, Reduce.QUANTILE, count=1, q=0.5)]
    got = _over_ranks([{"m2/turn_gap_p50": q[0]}, {"m2/turn_gap_p50": q[1]}])
    assert got == {"metrics/unreduced": 1.0}
    assert _over_ranks([a]) == a  # one rank: its own values


def test_an_undeclared_metric_raises_in_strict_mode_and_is_counted_otherwise(caplog):
    shares = [{"episode/count": summed(2), "new/thing": 1.0}, {"episode/count": summed(3), "new/thing": 3.0}]
    with pytest.raises(UndeclaredMetricError, match="new/thing"):
        _over_ranks(shares)
    got = _over_ranks(shares, strict=False)
    assert got == {"episode/count": 5.0, "new/thing": 2.0, "metrics/undeclared": 1.0}
    mixed = [{"k": summed(1)}, {"k": weighted_mean(1.0, 2)}]  # ranks disagree on the kind: not declared
    with pytest.raises(UndeclaredMetricError):
        _over_ranks(mixed)

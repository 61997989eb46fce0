"""Mechanism 2 under data parallelism (``torchrun --nproc_per_node=2``, gloo): the step's estimator phase on a
batch split over two ranks (whole tasks per rank, as ``tasks_for_step`` deals them) gives exactly the spans,
budgets and token advantages of the same batch on one rank (ALGORITHM.md §3.3-§3.5, §3.11 D)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
# turns of each rollout, per task; rank 0 holds tasks 0-1, rank 1 tasks 2-3 (ids rank * 2 + i). The largest task
# (2) is on rank 1, so rank 0's own block width, turn count and trajectory count all differ from the whole batch's.
LENGTHS = [[7, 6, 5], [5, 7, 6, 4], [14, 16, 15], [12, 10, 9, 13]]
L, D = 6, 6


def _whole_batch(seed: int = 0):
    """A canonical batch in identity order (TurnBatch), its old log-probs and its Mechanism 1 result, built with
    the core's own M1 functions from drifting per-trajectory thinking embeddings."""
    from alignopsd.engine.step.batch import TurnBatch
    from alignopsd.engine.step.teacher_pass import M1Result

    from alignopsd.rectification import eligibility, pairs_from_selection, select_sources, similarity_matrix

    g = torch.Generator().manual_seed(seed)
    task, roll, turn, outcome = [], [], [], []
    for t, rollouts in enumerate(LENGTHS):
        for r, n in enumerate(rollouts):
            task += [t] * n
            roll += [r] * n
            turn += list(range(n))
            outcome += [float((t + r) % 2)] * n
    m = len(task)
    ids = [torch.tensor(x) for x in (task, roll, turn)]
    anchors = torch.randn(len(LENGTHS), 4, D, generator=g)  # a task's few "situations"; turns drift between them
    phase = torch.tensor(turn, dtype=torch.float32) / 4.0 + torch.rand(m, generator=g)
    lo = phase.floor().long().clamp(max=2)
    frac = (phase - lo).clamp(0, 1)[:, None]
    base = (1 - frac) * anchors[ids[0], lo] + frac * anchors[ids[0], lo + 1]
    student = torch.nn.functional.normalize(base + 0.3 * torch.randn(m, D, generator=g), dim=1)
    teacher = torch.nn.functional.normalize(base + 0.3 * torch.randn(m, D, generator=g), dim=1)
    s_valid, t_valid = torch.rand(m, generator=g) > 0.05, torch.rand(m, generator=g) > 0.05
    H = similarity_matrix(teacher, student, ids[0])
    B = eligibility(ids[0], ids[1], t_valid, s_valid)
    pairs = pairs_from_selection(select_sources(H, B, *ids, gamma=0.3, top_k=2))
    lengths = torch.randint(1, L + 1, (m,), generator=g)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    old = -torch.rand(m, L, generator=g) * 3
    cb = TurnBatch(
        task=ids[0], rollout=ids[1], turn=ids[2],
        prompt_ids=torch.ones(m, 2, dtype=torch.long), prompt_mask=torch.ones(m, 2, dtype=torch.long),
        response_ids=torch.ones(m, L, dtype=torch.long), response_mask=mask.long(),
        outcome=torch.tensor(outcome), action_valid=torch.rand(m, generator=g) > 0.2,
    )  # fmt: skip
    diag = old + 0.5 * torch.randn(m, L, generator=g)
    cross = old[pairs[:, 1]] + 0.5 * torch.randn(pairs.shape[0], L, generator=g)
    return cb, old, M1Result(H, B, pairs, diag, cross, s_valid, t_valid)


def _share(cb, old, m1, tasks: list[int]):
    """The rows of ``tasks`` (a rank's share), with its M1 result: the same turns' similarities, eligibility and
    teacher scores, pairs renumbered (sources and targets are always of one task)."""
    from alignopsd.engine.step.teacher_pass import M1Result

    idx = torch.nonzero(torch.isin(cb.task, torch.tensor(tasks))).flatten()
    pos = torch.full((cb.size,), -1, dtype=torch.long)
    pos[idx] = torch.arange(idx.numel())
    keep = pos[m1.pairs[:, 1]] >= 0
    pairs = pos[m1.pairs[keep]]
    sub = M1Result(m1.H[idx][:, idx], m1.eligible[idx][:, idx], pairs, m1.diag[idx], m1.cross[keep])
    return idx, cb.select(idx), old[idx], sub


def _parts(cfg, rank: int, world_size: int):
    """What the step's estimator phase reads of the run's components (no model: the phase runs none)."""
    from alignopsd.engine.policy.base import ParallelLayout
    from alignopsd.engine.step.components import Components

    from alignopsd.estimators import get_estimator

    return Components(
        cfg=cfg, device=torch.device("cpu"), rank=rank, world_size=world_size, tokenizer=None,
        policy=SimpleNamespace(layout=ParallelLayout(dp_rank=rank, dp_size=world_size)),  # data parallel only
        generator=None, env=None, train_tasks=[], val_tasks=[], estimator=get_estimator(cfg.algorithm.estimator),
    )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("ablation, distance", [("E", "jsd"), ("E", "entropy"), ("E", "cosine"), ("D", "jsd")])
def test_estimator_phase_split_over_two_ranks_equals_one_rank(ablation, distance):
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import torch.distributed as dist
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.parallel.collectives import reduce_metrics
    from alignopsd.engine.step.recipe import estimate

    from alignopsd.credit import allocate_credit
    from alignopsd.samples import recording_samples

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    # the batch's distances are large (sharp profiles): with tau_max 0.10 every threshold would be clipped to it
    ov = [f"algorithm.ablation={ablation}", f"algorithm.credit.distance={distance}", "algorithm.credit.tau_max=0.9"]
    cfg = load_config(TINY, ov)
    phases = _parts(cfg, 0, 1).estimator.phases(cfg.algorithm)
    assert phases.mechanism2
    cb, old, m1 = _whole_batch()
    counts = torch.ones(cb.size, dtype=torch.long)
    one, spans_one, whole_metrics = estimate(_parts(cfg, 0, 1), cb, old, m1, 0, phases, counts)

    idx, cb_r, old_r, m1_r = _share(cb, old, m1, [2 * rank, 2 * rank + 1])
    with recording_samples():  # as a data-parallel step records (engine/step/recipe.py)
        two, spans_two, metrics = estimate(_parts(cfg, rank, 2), cb_r, old_r, m1_r, 0, phases, counts[idx])

    c1, c2 = one.credit, two.credit
    tau_metric = c1.threshold if math.isfinite(c1.threshold) else -1.0
    same = {"threshold": c2.threshold == c1.threshold and metrics["m2/segmentation_threshold"] == tau_metric}
    same["token_advantage"] = torch.equal(two.token_advantage, one.token_advantage[idx])
    for name in ("segment_index", "boundary_kind", "boundary_distance", "boundary_valid", "profile_valid",
                 "raw_density", "density", "turn_weight", "advantage", "residual"):  # fmt: skip
        same[name] = torch.equal(getattr(c2, name), getattr(c1, name)[idx])
    cut = bool((c2.boundary_kind == (4 if ablation == "D" else 1)).any())  # the spans were actually cut

    # the statistics matter: this share allocated alone (no whole-batch statistics) gets another threshold
    _, gap = two.rectified.gaps(old_r)
    alone = allocate_credit(
        gap, cb_r.response_mask.bool(), cb_r.outcome, cb_r.task, cb_r.rollout, cb_r.turn, m1_r.H, m1_r.eligible,
        cfg.algorithm.credit, invalid=~cb_r.action_valid,
    )  # fmt: skip
    differs = alone.threshold != c1.threshold

    # the estimator's m1/, m2/, adv/ and episode/ metrics of the two shares, reduced by their declarations, are
    # those of the whole batch on one rank
    shares: list = [None, None]
    dist.all_gather_object(shares, metrics)
    reduced = reduce_metrics(shares, strict=True)
    same["metric_keys"] = set(reduced) == set(whole_metrics)
    for k, v in whole_metrics.items():
        same[k] = reduced.get(k) == pytest.approx(v, rel=1e-5, abs=1e-7)

    got: list = [None, None]  # every rank's verdict first: a failing rank must not leave the other in a collective
    dist.all_gather_object(got, (same, cut, spans_two, differs))
    for r, (same_r, cut_r, _, _) in enumerate(got):
        assert all(same_r.values()), (r, [k for k, v in same_r.items() if not v])
        assert cut_r, r
    assert got[0][2] + got[1][2] == spans_one  # span lengths in global span order
    assert got[0][3] and got[1][3]

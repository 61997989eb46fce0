"""One training step of ALGORITHM.md §4, for every estimator of the registry: the recipe, nothing else.

Legend: R = turn rows on this rank, M = canonical turns, L = response length, P = cross pairs.

    rollout (student sampling + environment)                       -> TurnBatch [R]       engine/step/episodes.py
    canonical turns (§1.2)                                          -> M turns, identity order
    old log-probs (policy, fused head; entropy logged)              -> old_logp_ML         engine/step/rescoring.py
    reference log-probs when the KL coefficient is non-zero         -> ref_logp_ML
    teacher pass, as the estimator declares (§2.1-2.6)              -> M1Result            engine/step/teacher_pass.py
    rectification (§2.7), when the estimator aligns (own phase)     -> Rectified           alignopsd.estimators
    advantages: the estimator (GRPO, M2 credit, ...)                -> token advantage [M, L] + auxiliary terms
    PPO update over mini/micro-batches, exact global token-mean     -> metrics             engine/step/update.py
    weight sync to the generation engine

Only the phases the estimator declares are run (GRPO runs no teacher pass); every phase is timed by the step
profiler (engine/observe/profiler.py) and returns its metrics.

Robustness: a non-finite loss or gradient skips that optimiser step with a warning (weights unchanged);
with ``trainer.ppo.skip_no_signal`` a step whose advantages are provably all zero skips the update (logged as
``update/skipped``); failing environments and malformed outputs are counted by the rollout and never abort it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.parallel.collectives import all_reduce
from alignopsd.engine.parallel.tp_broadcast import broadcast_from_lead
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.components import Components
from alignopsd.engine.step.episodes import rollout_phase, step_seed, tasks_for_step
from alignopsd.engine.step.group_sampling import group_rollout, group_sampling
from alignopsd.engine.step.regions import region_metrics, response_regions
from alignopsd.engine.step.teacher_pass import M1Result, mechanism1, teacher_diagonal
from alignopsd.engine.step.update import ppo_update
from alignopsd.engine.step.whole_batch import globalise_spans, whole_batch
from torch import Tensor

from alignopsd.canonical import canonicalize
from alignopsd.estimators import EstimatorInputs, EstimatorOutput, EstimatorPhases, EstimatorSpec, rectify_inputs
from alignopsd.losses import rollout_mismatch_metrics
from alignopsd.reduction import same, summed, weighted_mean
from alignopsd.samples import recording_samples

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

log = logging.getLogger("alignopsd.step")


@dataclass
class StepOutput:
    metrics: dict[str, float]
    span_lengths: list[int] = field(default_factory=list)


def run_step(parts: Components, step: int) -> StepOutput:
    """One training step (see the module docstring). ``step`` is 0-based.

    With data-parallel ranks the values behind the step's percentile and std metrics are recorded
    (``alignopsd.samples``): the percentile and std metrics carry them to the reduction over ranks
    (engine/parallel/metric_reduce.py)."""
    if parts.world_size <= 1:
        return _step(parts, step)
    with recording_samples():
        return _step(parts, step)


def _step(parts: Components, step: int) -> StepOutput:
    cfg = parts.cfg
    prof = parts.profiler
    prof.start_step()
    phases = parts.estimator.phases(cfg.algorithm)
    metrics: dict[str, float] = {}

    # 1. rollout -------------------------------------------------------------------------------------------------
    batch, roll_metrics = rollout_batch(parts, step, teacher_prompts=phases.alignment or phases.teacher_diag)
    metrics.update(roll_metrics)
    if cfg.trainer.ppo.skip_no_signal and _skip_everywhere(parts, no_signal(cfg, parts.estimator, batch)):
        log.info("step %d: no learnable signal (constant outcomes per task); update skipped", step)
        metrics.update({"update/skipped": same(1.0), "update/zero_advantage": same(1.0), "actor/loss": same(0.0)})
        if parts.audit is not None:
            metrics.update(parts.audit.record_skipped(step + 1, batch.size))
        metrics.update(prof.end_step())
        return StepOutput(metrics=metrics)

    # 2-5. canonical turns, old and reference log-probs, teacher pass --------------------------------------------
    scored, score_metrics = score_batch(parts, batch, phases)
    metrics.update(score_metrics)
    cb, old_logp, ref_logp, m1 = scored.cb, scored.old_logp, scored.ref_logp, scored.m1

    # 6. advantages ----------------------------------------------------------------------------------------------
    est_out, span_lengths, est_metrics = estimate(parts, cb, old_logp, m1, step, phases, scored.counts)
    metrics.update(est_metrics)
    regions = None
    if est_out.rectified is not None or parts.audit is not None:  # shared by the region metrics and the audit
        regions = response_regions(cb.response_ids, cb.response_mask, parts.tokenizer)
    if est_out.rectified is not None:
        metrics.update(region_metrics(regions, cb.response_mask, old_logp, est_out.rectified))
    adv_ML = est_out.token_advantage
    metrics["adv/token_advantage_abs_mean"] = _masked_mean(adv_ML.abs(), cb.response_mask)

    # audit records (§4.3 "Audit"): reads the step's tensors, draws no random numbers, never raises
    if parts.audit is not None:
        metrics.update(parts.audit.record(step + 1, cb, scored.counts, old_logp, adv_ML, est_out, m1, regions))

    # 7. update --------------------------------------------------------------------------------------------------
    with prof.phase("update"):
        upd = ppo_update(parts, cb, old_logp, ref_logp, adv_ML, est_out.aux)
    metrics.update(upd)

    # 8. weight sync ---------------------------------------------------------------------------------------------
    if not upd.get("update/skipped", 0.0):
        with prof.phase("weight_sync"):
            parts.sync_weights()
    metrics.update(prof.end_step())
    return StepOutput(metrics=metrics, span_lengths=span_lengths)


def rollout_batch(parts: Components, step: int, *, teacher_prompts: bool) -> tuple[TurnBatch, dict[str, float]]:
    """The turn batch of training step ``step`` (0-based) and its rollout metrics: the step's tasks and sampling seed
    (engine/step/episodes.py: fixed by the run's seed, the step and the rank), played once per tensor-parallel group
    (the group's other ranks receive it); ``teacher_prompts``: also build the privileged prompts of the teacher pass.
    The generation engine sleeps afterwards, until the teacher pass or the weight sync."""
    cfg = parts.cfg
    tasks = tasks_for_step(
        parts.train_tasks, step, cfg.env.tasks_per_step, cfg.trainer.seed, parts.rank, parts.world_size
    )
    seed = step_seed(cfg.trainer.seed, step, parts.rank)
    # once per tensor-parallel group, the group's other ranks receive the batch (engine/step/group_sampling.py)
    batch, metrics = group_rollout(
        parts, lambda: rollout_phase(parts, tasks, seed=seed, validation=False, teacher_prompts=teacher_prompts)
    )
    parts.release_generation()  # scoring and training follow: the engine sleeps until the teacher pass or the sync
    return batch, metrics


@dataclass
class ScoredBatch:
    """A batch's canonical turns and what the model passes computed of them: what an estimator reads of a step.

    cb: the canonical batch, M rows in identity order (§1.2); counts: [M] rows per canonical turn; old_logp,
    ref_logp: [M, L] student and reference log-probs (ref None without the KL term); m1: the teacher pass's result
    (None where no phase asked for one)."""

    cb: TurnBatch
    counts: Tensor
    old_logp: Tensor
    ref_logp: Tensor | None
    m1: M1Result | None


def score_batch(parts: Components, batch: TurnBatch, phases: EstimatorPhases) -> tuple[ScoredBatch, dict[str, float]]:
    """Canonical turns, old and reference log-probs and the teacher pass that ``phases`` declare (Mechanism 1 with
    alignment, else the teacher diagonal where asked), with their metrics."""
    canon = canonicalize(batch.task.tolist(), batch.rollout.tolist(), batch.turn.tolist())
    cb = batch.select(canon.first_row)  # canonical batch, M rows in identity order
    metrics: dict[str, float] = {"batch/rows": summed(batch.size), "batch/turns": summed(cb.size)}
    old_logp, ref_logp, lp_metrics = logprob_phase(parts, cb)
    metrics.update(lp_metrics)
    m1 = None
    if phases.alignment:
        # teacher generation and encoding once per tensor-parallel group
        m1, m1_metrics = mechanism1(group_sampling(parts), cb)
        metrics.update(m1_metrics)
    elif phases.teacher_diag:
        m1 = teacher_diagonal(parts, cb)
    return ScoredBatch(cb, canon.counts, old_logp, ref_logp, m1), metrics


def logprob_phase(parts: Components, cb: TurnBatch) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """(old log-probs [M, L], reference log-probs [M, L] or None, metrics): the student and reference passes."""
    metrics: dict[str, float] = {}
    with parts.profiler.phase("old_logprob"):
        out = parts.rescorer(cb, student=True, teacher=False, with_entropy=True)
        if out.entropy is not None:
            metrics["actor/entropy_old"] = _masked_mean(out.entropy, cb.response_mask)
    if "student/token_forwards" in out.stats:  # positions the pass pushed (shared prompt prefixes once)
        metrics["actor/old_logprob_token_forwards"] = summed(out.stats["student/token_forwards"])
    metrics.update(padding_fraction(out.stats, "actor/padding_fraction_old_logprob"))
    # the sampler's vs the trainer's log-probs: measured here, or by the rescorer when it reused the sampler's
    metrics.update({k: v for k, v in out.stats.items() if k.startswith("mismatch/")})  # declared where measured
    if cb.rollout_logp is not None and not out.stats.get("student/reused"):
        metrics.update(rollout_mismatch_metrics(cb.rollout_logp, out.old_logp, cb.response_mask))
    ref_logp = None
    if parts.ref_scorer is not None:
        with parts.profiler.phase("reference"):
            ref = parts.ref_scorer(cb, student=True, teacher=False)
        ref_logp = ref.old_logp
        metrics.update(padding_fraction(ref.stats, "actor/padding_fraction_ref"))
    return out.old_logp, ref_logp, metrics


def padding_fraction(stats: dict, name: str) -> dict[str, float]:
    """``{name: share of the positions a student pass pushed that carry no token}`` from its counts, over all ranks
    (weighted by the positions); empty where the pass pushed nothing or its scorer counts no ``real_tokens``."""
    pushed, real = stats.get("student/token_forwards", 0), stats.get("student/real_tokens", 0)
    if not pushed or not real:
        return {}
    return {name: weighted_mean(1.0 - real / pushed, pushed)}


def estimate(
    parts: Components,
    cb: TurnBatch,
    old_logp: Tensor,
    m1: M1Result | None,
    step: int,
    phases: EstimatorPhases,
    counts: Tensor,
) -> tuple[EstimatorOutput, list[int], dict[str, float]]:
    """Run the configured estimator; returns (its output, span lengths of the M2 segments, metrics).

    With alignment, rectification (§2.7) runs first as its own ``rectify`` phase (an alignment cost), and the
    estimator takes its result. ``counts``: [M] rows per canonical turn (§1.2).

    Data parallelism: ``cb`` is this rank's share of the step's batch (whole tasks). Mechanism 2's whole-batch
    statistics (threshold, ln M, block width, trajectory offset) are gathered over the data-parallel ranks
    before the estimator runs, and the span indices made global after it (engine/step/whole_batch.py), so the
    spans, budgets and token advantages are exactly those of the whole batch on one rank. Under tensor
    parallelism the group's first rank runs the estimator and the others receive its output."""
    inputs = estimator_inputs(parts, cb, old_logp, m1, step, counts)
    dev = parts.device
    credit_cfg, dp = parts.cfg.algorithm.credit, (parts.rank, parts.world_size, parts.dp_group)

    def decide() -> EstimatorOutput:
        if phases.alignment:
            with parts.profiler.phase("rectify"):
                inputs.rectification = rectify_inputs(inputs, parts.cfg.algorithm)
        with parts.profiler.phase("m2" if phases.mechanism2 else "advantage"):
            if phases.mechanism2:  # data-parallel collectives: among the first ranks of the groups only
                inputs.whole_batch = whole_batch(inputs, credit_cfg, *dp)  # None single-process
            res = parts.estimator(inputs, parts.cfg.algorithm)
            if phases.mechanism2:
                globalise_spans(res.credit, credit_cfg, *dp)
        return res

    # once per tensor-parallel group: M2's spans and the advantages are the first rank's
    # (engine/parallel/tp_broadcast.py)
    out = broadcast_from_lead(parts.policy, decide, device=dev)
    metrics = {k: v for k, v in out.metrics.items() if isinstance(v, (int, float))}  # declared by the estimator
    spans: list[int] = []
    seg = out.credit.segment_index if out.credit is not None else None
    if seg is not None:
        ids = torch.as_tensor(seg)
        ids = ids[ids >= 0]
        if ids.numel():
            spans = [int(x) for x in torch.bincount(ids).tolist() if x > 0]
    return out, spans, metrics


def estimator_inputs(
    parts: Components, cb: TurnBatch, old_logp: Tensor, m1: M1Result | None, step: int, counts: Tensor
) -> EstimatorInputs:
    """The estimator's inputs of a canonical batch, on the policy's device: on CUDA the core reaches the Triton
    kernels. ``m1``: the teacher pass's result (None: no teacher pass); ``counts``: [M] rows per canonical turn."""
    m1 = m1 or M1Result()
    dev = parts.device

    def on(x: Tensor | None) -> Tensor | None:
        return x.to(dev) if x is not None else None

    return EstimatorInputs(
        old_logp=on(old_logp),
        mask=on(cb.response_mask.bool()),
        outcome=on(cb.outcome.float()),
        task=on(cb.task),
        rollout=on(cb.rollout),
        turn=on(cb.turn),
        invalid=on(~cb.action_valid.bool()),
        diag=on(m1.diag),
        cross=on(m1.cross),
        pairs=on(m1.pairs),
        H=on(m1.H),
        eligible=on(m1.eligible),
        copies=on(counts),
        step=step,
    )


def no_signal(cfg: RunConfig, spec: EstimatorSpec, batch: TurnBatch) -> bool:
    """True when every token advantage is provably 0 before any model pass: the estimator declares its advantage
    outcome-scaled (A times non-negative weights) with no auxiliary term under this config, each task's outcomes
    are equal (A = 0) and, with the invalid-action penalty on, each task's validity flags are equal too."""
    a = cfg.algorithm
    if not spec.outcome_scaled or spec.has_aux(a):
        return False
    for t in batch.task.unique():
        sel = batch.task == t
        if bool((batch.outcome[sel] != batch.outcome[sel][0]).any()):
            return False
        if a.use_invalid_penalty and bool((batch.action_valid[sel] != batch.action_valid[sel][0]).any()):
            return False
    return True


def _skip_everywhere(parts: Components, skip: bool) -> bool:
    """One collective on every rank: skip only if all data-parallel ranks agree."""
    if parts.world_size <= 1:
        return skip
    return all_reduce([float(skip)], "min", parts.world_size, parts.dp_group)[0] == 1.0


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    """The mean over the masked tokens, declared as a mean over them (``alignopsd.reduction``)."""
    m = mask.bool()
    n = int(m.sum())
    return weighted_mean(float(x[m].float().mean()) if n else 0.0, n)

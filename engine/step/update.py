"""The PPO update (ALGORITHM.md §3.12): the micro-batch plan, one micro step, the non-finite guard.

Legend: M = canonical turns of this rank, L = response length, b = rows of one micro-batch.

The loss of every micro-batch is :func:`alignopsd.losses.actor_loss` (PPO with dual clip, entropy bonus, k3 KL to
the reference, the estimator's auxiliary terms), the function the core's tests check; both training heads call it:
the fused head loss (``policy.response_loss``: the head's gradients are formed with the log-probs) and autograd
through ``policy.response_logprobs(grad=True)``. The fused head needs a loss that is a sum of per-token terms;
each estimator declares whether its loss is (``EstimatorSpec.loss_separable``).

Exact global token-mean: each rank splits its M rows into the same number of mini-batches (the maximum over
ranks) and each mini-batch into the same number of micro-batches (engine/step/micro_batches.py: by tokens from
rows sorted by length, ``trainer.ppo.max_token_len_per_gpu``, or by rows), so data-parallel gradient averaging stays
in lock-step; each micro-batch's token-mean is scaled by :func:`alignopsd.losses.microbatch_scales` (its tokens /
(all ranks' tokens of the mini-batch / world size)). ``actor/padding_fraction``: the share of the positions the
update's forwards compute that carry no token; ``update/micro_batches``: forwards/backwards per rank. Where
``trainer.ppo.use_remove_padding`` is auto on a CPU, the run's first update times packed against padded rows on its own
micro-batches, forward and backward, and keeps the faster (engine/step/packing_trial.py); the counts include the
trial's second passes, and a micro-batch it ran twice counts once in ``update/nonfinite_loss``.
The update runs on the canonical batch (one row per turn), so every row carries weight 1 (§1.2).

Rollout correction (``trainer.ppo.rollout_is``, off by default as in the authors' runs): truncated or masked
importance sampling of π_trainer / π_rollout at token or sequence level (:func:`rollout_correction`).

Non-finite guard: a non-finite log-prob (autograd path or inside the fused head) or loss turns that mini-batch's
gradients into NaN, so the backend skips the optimiser step (weights and optimiser state unchanged) on every
rank, and ``update/nonfinite_loss`` counts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.parallel import devices
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.micro_batches import Footprint, MicroBatch, RowGeometry, plan_update
from alignopsd.engine.step.packing_trial import PackingTrial
from torch import Tensor

from alignopsd.estimators import get_estimator
from alignopsd.losses import AuxTerm, actor_loss, rollout_is_weights
from alignopsd.reduction import same, summed, weighted_mean

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

log = logging.getLogger("alignopsd.update")


@dataclass
class UpdateInputs:
    """The frozen tensors of one update, [M, L] on the policy's device (mask as float)."""

    cb: TurnBatch
    old_logp: Tensor
    ref_logp: Tensor | None
    adv: Tensor
    mask: Tensor
    aux: list
    is_weight: Tensor | None = None  # [M, L] rollout importance weights (trainer.ppo.rollout_is), None: off
    is_keep: Tensor | None = None  # [M, L] bool, the tokens the rollout correction accepts, None: off

    def policy_mask(self) -> Tensor:
        """[M, L] float: the tokens every loss term and the global token-mean count (``mask`` and ``is_keep``)."""
        return self.mask if self.is_keep is None else self.mask * self.is_keep


def aux_to(term: AuxTerm, device: torch.device) -> AuxTerm:
    """The auxiliary term with its frozen tensors on ``device`` (where the micro-batch loss is computed)."""
    gap = term.gate_gap_ML.to(device) if term.gate_gap_ML is not None else None
    return dataclasses.replace(term, teacher_ML=term.teacher_ML.to(device), gate_gap_ML=gap)


def _loss_fn(cfg: RunConfig, inp: UpdateInputs, ix: Tensor):
    """The micro-batch objective ``(logp_bL, ent_bL) -> (loss, stats)`` of rows ``ix`` (actor_loss of §3.12).

    A non-finite log-prob on a policy token gives a NaN loss (so the step is skipped) instead of an error: inside
    the fused head the log-probs only exist within this call."""
    a = cfg.algorithm
    mk = inp.mask[ix]
    keep = inp.is_keep[ix] if inp.is_keep is not None else None
    old, adv = inp.old_logp[ix], inp.adv[ix]
    ref = inp.ref_logp[ix] if inp.ref_logp is not None else None
    sel = inp.policy_mask()[ix].bool()

    def loss_fn(logp_bL: Tensor, ent_bL: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        logp_bL = logp_bL.float()
        if not bool(torch.isfinite(logp_bL[sel]).all()):
            return logp_bL.nan_to_num(0.0).sum() * float("nan"), {}
        return actor_loss(
            logp_bL,
            old,
            adv,
            mk,
            entropy=ent_bL.float() if (ent_bL is not None and a.entropy_coef > 0) else None,
            entropy_coef=float(a.entropy_coef),
            ref_logp=ref,
            kl_coef=float(a.kl_coef) if ref is not None else 0.0,
            aux=inp.aux,
            rows=ix,
            is_weight=inp.is_weight[ix] if inp.is_weight is not None else None,
            is_keep=keep,
            clip_low=float(a.clip_low),
            clip_high=float(a.clip_high),
            dual_clip=float(a.dual_clip),
        )

    return loss_fn


def micro_step(parts, inp: UpdateInputs, mb: MicroBatch, fused: bool, input_ids: Tensor, attn: Tensor):
    """Forward + backward of one micro-batch. Returns (stats, loss or None when non-finite)."""
    cfg = parts.cfg
    ix = torch.tensor(mb.rows, dtype=torch.long, device=inp.mask.device)
    loss_fn = _loss_fn(cfg, inp, ix)
    with_ent = cfg.algorithm.entropy_coef > 0
    length = inp.cb.response_length
    temp = cfg.generation.temperature
    if fused:  # the head's gradients are formed with the log-probs (three matmuls instead of four)
        logp, ent, carrier = parts.policy.response_loss(
            input_ids[ix],
            attn[ix],
            length,
            lambda lp, en: loss_fn(lp, en)[0],
            loss_fill=inp.old_logp[ix],
            temperature=temp,
            with_entropy=with_ent,
        )
        with torch.no_grad():
            loss, stats = loss_fn(logp, ent)
        backward_of = carrier
    else:
        logp, ent = parts.policy.response_logprobs(
            input_ids[ix], attn[ix], length, temperature=temp, with_entropy=with_ent, grad=True
        )
        loss, stats = loss_fn(logp, ent)
        backward_of = loss
    finite = bool(torch.isfinite(loss))
    if not finite:  # NaN gradients make the optimiser step skip (on every rank, through the all-reduce)
        log.warning("non-finite loss (%s) in a micro-batch: the optimiser step will be skipped", float(loss.detach()))
        backward_of = backward_of * float("nan")
    (backward_of * mb.scale).backward()
    return stats, (float(loss.detach()) if finite else None)


def ppo_update(
    parts, cb: TurnBatch, old_logp: Tensor, ref_logp: Tensor | None, adv_ML: Tensor, aux_terms: list
) -> dict[str, float]:
    """PPO over mini- and micro-batches with the exact global token-mean of §3.12 (see the module docstring)."""
    cfg = parts.cfg
    policy = parts.policy
    world, group = parts.world_size, parts.dp_group
    dev = parts.device
    mask = cb.response_mask.float().to(dev)
    inp = UpdateInputs(
        cb,
        old_logp.float().to(dev),
        ref_logp.float().to(dev) if ref_logp is not None else None,
        adv_ML.float().to(dev) * mask,
        mask,
        [aux_to(term, dev) for term in aux_terms],
    )

    out: dict[str, float] = rollout_correction(cfg, cb, inp)

    fused = bool(cfg.trainer.ppo.fused_head_loss and policy.supports_fused_loss)
    if fused and not get_estimator(cfg.algorithm.estimator).loss_separable:  # declared by the estimator
        log.warning(
            "the policy loss of estimator %r couples tokens (not a sum of per-token terms): the update uses "
            "autograd through the log-prob head instead of the fused head loss",
            cfg.algorithm.estimator,
        )
        fused = False
    geo = RowGeometry.of(cb.prompt_mask, cb.response_mask)
    plan = plan_update(
        inp.policy_mask(),
        cfg.trainer.ppo.mini_batch_size // world,
        cfg.trainer.ppo.micro_batch_size,
        world,
        group,
        geometry=geo,
        token_budget=parts.update_tokens,  # the config's, cut to what the activations' memory allows
    )
    input_ids, attn = devices.to_device(cb.input_ids(), dev), devices.to_device(cb.attention_mask(), dev)
    n_opt, skipped, grad_norms, n_mini = 0, 0, [], len(plan)
    trial = PackingTrial(policy, group, world)  # packed or padded rows, timed here where auto on a CPU
    tally = PassTally(geo, n_mini)

    def step(m: MicroBatch):
        return micro_step(parts, inp, m, fused, input_ids, attn)

    for i, mbs in enumerate(plan):
        if not mbs:
            continue
        log.info("update: mini-batch %d/%d (%d micro-batches)", i + 1, n_mini, len(mbs))
        for j, mb in enumerate(mbs):
            last = j == len(mbs) - 1
            tally.add(trial.run(step, mb, contextlib.nullcontext if last else policy.no_sync))
        res = policy.optimizer_step(cfg.trainer.optimizer.grad_clip)
        n_opt += 1
        skipped += int(bool(res.get("skipped")))
        grad_norms.append(float(res.get("grad_norm", 0.0)))
        out["actor/lr"] = same(res.get("lr", cfg.trainer.optimizer.lr))
    trial.settle()  # an update of fewer micro-batches than the trial wants chooses on those it ran
    out.update(tally.metrics())
    finite = [g for g in grad_norms if math.isfinite(g)]
    # the norm of the all-reduced gradients, and the step plan every rank keeps in lock-step: whole-batch values
    out["actor/grad_norm"] = same(sum(finite) / len(finite) if finite else float("nan"))
    out["update/fused_head_loss"] = same(1.0 if fused else 0.0)
    out["update/optimizer_steps"] = same(n_opt)
    out["update/skipped_optimizer_steps"] = same(skipped)
    out["update/skipped"] = same(1.0 if n_opt and skipped == n_opt else 0.0)
    return out


class PassTally:
    """What the update's forwards and backwards ran, the packing trial's second passes included: the positions they
    computed (``actor/padding_fraction``), their number (``update/micro_batches``), the micro-batches whose loss was
    not finite (``update/nonfinite_loss``: once per micro-batch, however many passes) and the loss statistics."""

    def __init__(self, geo: RowGeometry, n_mini: int) -> None:
        self.geo, self.n_mini = geo, n_mini
        self.fp, self.passes, self.nonfinite = Footprint(), 0, 0
        self.totals: dict[str, float] = {}

    def add(self, ran: list[tuple[MicroBatch, tuple, bool]]) -> None:
        """One micro-batch's passes (``PackingTrial.run``: micro-batch as run, (stats, loss or None), packed)."""
        self.nonfinite += any(loss is None for _, (_, loss), _ in ran)
        for m, (stats, loss), packed in ran:
            self.fp.add(self.geo, m.rows, packed)
            self.passes += 1
            if loss is not None and not m.dummy:
                for k, v in stats.items():
                    self.totals[k] = self.totals.get(k, 0.0) + v * m.scale / self.n_mini

    def metrics(self) -> dict[str, float]:
        out = {"update/micro_batches": same(self.passes)}  # forwards and backwards per rank (lock-step across ranks)
        if self.nonfinite:
            out["update/nonfinite_loss"] = summed(self.nonfinite)
        out["actor/padding_fraction"] = weighted_mean(self.fp.padding_fraction, self.fp.computed)
        # each rank's share is scaled to the global token-mean (microbatch_scales): the mean over the ranks is the whole
        out.update({k: weighted_mean(v, 1) for k, v in self.totals.items()})
        return out


def rollout_correction(cfg: RunConfig, cb: TurnBatch, inp: UpdateInputs) -> dict[str, float]:
    """Rollout-trainer mismatch correction (``trainer.ppo.rollout_is``): importance weights π_trainer / π_rollout of
    the sampled tokens (truncated, or masked outside the accepted range at token or sequence level). Rejected
    tokens are left out through ``actor_loss(is_keep=...)``, so every loss term and the global token-mean denominator
    (:meth:`UpdateInputs.policy_mask`) skip them. Updates ``inp`` in place; returns the correction's metrics (none
    when off)."""
    mode = cfg.trainer.ppo.rollout_is
    if mode == "off":
        return {}
    if cb.rollout_logp is None:
        log.warning("trainer.ppo.rollout_is: the batch carries no rollout log-probs; no correction this step")
        return {"rollout_is/unavailable": summed(1)}
    level, kind = mode.split("_")
    w_ML, keep_ML, stats = rollout_is_weights(
        cb.rollout_logp.float().to(inp.mask.device),
        inp.old_logp,
        inp.mask.bool(),
        level=level,
        mode=kind,
        threshold=float(cfg.trainer.ppo.rollout_is_threshold),
        lower=cfg.trainer.ppo.rollout_is_lower,
    )
    inp.is_keep = keep_ML.to(inp.mask.device)
    inp.is_weight = w_ML
    return stats

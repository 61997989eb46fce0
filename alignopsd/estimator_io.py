"""What an advantage estimator reads and returns: :class:`EstimatorInputs`, the step's tensors on the canonical
turns, checked once on construction, and :class:`EstimatorOutput`, the token advantages, auxiliary loss terms and
metrics. The estimators themselves and their registry are in :mod:`alignopsd.estimators`.

Legend: M = canonical turns, L = response length, P = kept M1 pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from alignopsd._checks import as_tensor, check_finite_fast, check_ids, check_ndim, check_shape
from alignopsd.credit import Credit
from alignopsd.credit_config import WholeBatch
from alignopsd.losses import AuxTerm
from alignopsd.rectification import Rectified

__all__ = ["EstimatorInputs", "EstimatorOutput"]


@dataclass
class EstimatorInputs:
    """The step tensors an estimator reads, on the M canonical turns (all detached).

    old_logp: [M, L] ℓ^old, student log-probs at rollout. mask: [M, L] policy-loss mask (bool or 0/1).
    outcome: [M] episode reward R (equal across a trajectory). task, rollout, turn: [M] integer ids.
    invalid: [M] bool, the turn's action was invalid (None: all valid).
    diag: [M, L] ℓ^diag, teacher log-probs of each turn's response under its own privileged prompt.
    cross: [P, L] cross-scored log-probs of ``pairs``; pairs: [P, 2] (source, target) grouped by target.
    H: [M, M] H[source, target]; eligible: [M, M] bool B[source, target].
    copies: [M] long, rows per canonical turn (k; None: 1), used by alignopsd_m1's all-row statistics.
    step: the training step (0-based), for schedules (RLSD λ).
    rectification: a precomputed :func:`rectify_inputs` result (the engine computes it first, to time it as its
    own phase); None: the estimator computes it.
    whole_batch: the turns are one data-parallel share of the step's batch (whole tasks) and these are the whole
    batch's statistics, gathered over the ranks by the engine (:class:`alignopsd.credit_config.WholeBatch`;
    Mechanism 2's threshold, ln M, block width, trajectory offset); None: the turns are the whole batch. Every
    other estimator statistic is per task, trajectory or turn, so only Mechanism 2 reads it.
    """

    old_logp: Tensor
    mask: Tensor
    outcome: Tensor
    task: Tensor
    rollout: Tensor
    turn: Tensor
    invalid: Tensor | None = None
    diag: Tensor | None = None
    cross: Tensor | None = None
    pairs: Tensor | None = None
    H: Tensor | None = None
    eligible: Tensor | None = None
    copies: Tensor | None = None
    step: int = 0
    rectification: tuple[Rectified, Tensor, dict[str, float]] | None = None
    whole_batch: WholeBatch | None = None

    def __post_init__(self) -> None:
        self.task, self.rollout, self.turn = check_ids(self.task, self.rollout, self.turn)
        M = self.task.numel()
        old = as_tensor(self.old_logp, "old_logp")
        check_ndim(old, "old_logp", 2)
        if old.shape[0] != M:
            raise ValueError(f"old_logp: expected {M} rows like task, got {tuple(old.shape)}")
        check_finite_fast(old, "old_logp")
        self.old_logp = old.detach().float()
        L = old.shape[1]
        mask = as_tensor(self.mask, "mask")
        check_shape(mask, "mask", (M, L))
        self.mask = mask
        out = as_tensor(self.outcome, "outcome")
        check_shape(out, "outcome", (M,))
        check_finite_fast(out, "outcome")
        self.outcome = out
        if self.invalid is not None:
            inv = as_tensor(self.invalid, "invalid")
            check_shape(inv, "invalid", (M,))
            if inv.dtype != torch.bool:
                raise ValueError(f"invalid: expected a bool tensor, got {inv.dtype}")
            self.invalid = inv
        if self.diag is not None:
            d = as_tensor(self.diag, "diag")
            check_shape(d, "diag", (M, L))
            check_finite_fast(d, "diag")
            self.diag = d.detach().float()
        if self.copies is not None:
            k = as_tensor(self.copies, "copies")
            check_shape(k, "copies", (M,))
            if k.is_floating_point() or bool((k < 1).any()):
                raise ValueError("copies: expected integer counts >= 1")
            self.copies = k.long()
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"step: expected an integer >= 0, got {self.step!r}")
        if bool((self.mask.float().sum(1) <= 0).any()):
            bad = int(torch.nonzero(self.mask.float().sum(1) <= 0)[0])
            raise ValueError(f"mask: turn {bad} has no policy token (every canonical turn needs at least one)")

    @property
    def mask_f(self) -> Tensor:
        return self.mask.to(torch.float32)

    def require(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{missing[0]}: required by this estimator but not given")


@dataclass
class EstimatorOutput:
    """token_advantage: [M, L] float32 (0 outside the mask); aux: auxiliary loss terms to add;
    metrics: flat dict of floats; rectified / credit: the M1 / M2 results when computed."""

    token_advantage: Tensor
    aux: list[AuxTerm] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    rectified: Rectified | None = None
    credit: Credit | None = None

"""The config sections of the built-in estimators, and the typed view an estimator gets of the config.

:class:`RectifyConfig` (Mechanism 1), :class:`AlignmentLossConfig`, :class:`SdarConfig`, :class:`RlsdConfig` and
:class:`OpsdConfig` (with ``alignopsd.credit_config.CreditConfig``, Mechanism 2) are registered with the estimators
that read them (``register_estimator(..., settings=...)`` in alignopsd.estimators, the way any estimator gives itself
settings) and read and written by ``alignopsd.config.AlgorithmConfig`` as ``algorithm.<key>`` (re-exported there).
:class:`EstimatorConfig` is the part of ``AlgorithmConfig`` the estimators read: a structural type, so the registry
can be typed without importing the config module, which checks estimator names against that registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from alignopsd.config_values import bool_field, choice_field, int_field, real_field

__all__ = ["AlignmentLossConfig", "EstimatorConfig", "OpsdConfig", "RectifyConfig", "RlsdConfig", "SdarConfig"]


# ---------------------------------------------------------------------------------------------------------- sections


@dataclass
class RectifyConfig:
    """Mechanism 1 (ALGORITHM.md §2.4–2.7)."""

    gamma: float = 0.70
    """Similarity threshold γ for source candidates (inclusive); also the confidence floor and M2 profile validity."""
    top_k: int = 3
    """K: at most this many sources per target, after one-per-sibling-rollout."""
    alpha_max: float = 0.8
    """α_max: the largest correction strength; α = clip(α_max·ρ, 0, α_max). 0 disables rectification."""
    temperature: float = 0.1
    """T_agg: aggregation temperature of the source weights ω = softmax(h / T_agg)."""
    mode: Literal["probability_mixture", "log_mean"] = "probability_mixture"
    """Cross-score aggregation across sources; the final blend with the diagonal is always geometric."""
    source_rollout_cap: int = 1
    """Sources per sibling rollout; the method defines it as exactly 1."""
    action_filter: bool = False
    """Enable the action-consistency filter (§2.5); it only removes pairs."""
    action_threshold: float = 0.8
    """τ_a: minimum action-embedding cosine for a kept pair, a real number in [-1, 1]."""

    def __post_init__(self) -> None:
        real_field("gamma", self.gamma, lo=-1.0)
        if self.gamma >= 1.0:
            raise ValueError(f"gamma: must be < 1, got {self.gamma}")
        int_field("top_k", self.top_k, lo=1)
        real_field("alpha_max", self.alpha_max, lo=0.0, hi=1.0)
        real_field("temperature", self.temperature, lo=0.0, lo_open=True)
        choice_field("mode", self.mode, ("probability_mixture", "log_mean"))
        int_field("source_rollout_cap", self.source_rollout_cap)
        if self.source_rollout_cap != 1:
            raise ValueError(f"source_rollout_cap: must be exactly 1, got {self.source_rollout_cap}")
        bool_field("action_filter", self.action_filter)
        real_field("action_threshold", self.action_threshold, lo=-1.0, hi=1.0)


@dataclass
class AlignmentLossConfig:
    """M1-only alignment loss (§2.9): coef · token-mean(σ(β δ̃) ⊙ (ℓ̃ − ℓ_θ))."""

    coef: float = 0.01
    """Weight of the alignment term in the actor loss (>= 0)."""
    beta: float = 5.0
    """Gate sharpness β (> 0) of σ(β δ̃), δ̃ frozen at rollout."""

    def __post_init__(self) -> None:
        real_field("coef", self.coef, lo=0.0)
        real_field("beta", self.beta, lo=0.0, lo_open=True)


@dataclass
class SdarConfig:
    """SDAR auxiliary (§2.10): diagonal teacher, gate from the current (detached) policy log-probs."""

    enabled: bool = False
    """Add the auxiliary term (ALFWorld-3B profile; always on for the ``sdar`` estimator)."""
    coef: float = 0.01
    """Weight of the auxiliary term (>= 0)."""
    beta: float = 5.0
    """Gate sharpness β (> 0)."""

    def __post_init__(self) -> None:
        bool_field("enabled", self.enabled)
        real_field("coef", self.coef, lo=0.0)
        real_field("beta", self.beta, lo=0.0, lo_open=True)


@dataclass
class RlsdConfig:
    """RLSD baseline: Â = A·((1−λ) + λ·clip(exp(sign(A)·Δ), clip_low, clip_high)), Δ = ℓ^diag − ℓ^old."""

    lambda_init: float = 0.5
    """λ at step 0, in [0, 1]."""
    decay_steps: int = 150
    """λ decays linearly to 0 over this many steps (λ = λ_init·max(0, 1 − step/decay_steps))."""
    clip_low: float = 0.8
    """Lower clip of the per-token multiplier (> 0)."""
    clip_high: float = 1.2
    """Upper clip of the per-token multiplier (>= clip_low)."""

    def __post_init__(self) -> None:
        real_field("lambda_init", self.lambda_init, lo=0.0, hi=1.0)
        int_field("decay_steps", self.decay_steps, lo=1)
        real_field("clip_low", self.clip_low, lo=0.0, lo_open=True)
        real_field("clip_high", self.clip_high, lo=self.clip_low)


@dataclass
class OpsdConfig:
    """On-policy self-distillation baselines (``opsd``, ``grpo_opsd``) with the diagonal teacher."""

    coef: float = 1.0
    """``opsd``: weight of the gated distillation term (the SDAR form, no outcome advantage) (>= 0)."""
    beta: float = 5.0
    """``opsd``: gate sharpness β (> 0)."""
    mix: float = 0.5
    """``grpo_opsd``: global mixing strength λ_mix ∈ [0, 1] of the step-normalised token shaping."""
    clip: float = 0.2
    """``grpo_opsd``: local trust region α_clip ∈ [0, 1): multipliers clipped to [1 − α_clip, 1 + α_clip]."""

    def __post_init__(self) -> None:
        real_field("coef", self.coef, lo=0.0)
        real_field("beta", self.beta, lo=0.0, lo_open=True)
        real_field("mix", self.mix, lo=0.0, hi=1.0)
        real_field("clip", self.clip, lo=0.0)
        if self.clip >= 1.0:
            raise ValueError(f"clip: must be < 1, got {self.clip}")


class EstimatorConfig(Protocol):
    """What an estimator reads of its config (``alignopsd.config.AlgorithmConfig`` has all of it): the method-wide
    settings, and its own sections by key."""

    estimator: str
    kl_coef: float
    norm_by_std: bool
    use_invalid_penalty: bool
    invalid_penalty: float
    grpo_scope: str

    @property
    def effective_alpha_max(self) -> float: ...

    def section(self, name: str) -> Any:
        """A config section by its key, registered with an estimator (``settings=``)."""
        ...

"""Settings of Mechanism 2 (ALGORITHM.md §3, defaults §5): :class:`CreditConfig` and its allowed values."""

from __future__ import annotations

import math
from dataclasses import dataclass

from alignopsd import _native
from alignopsd._checks import check_choice, check_real

__all__ = ["DISTANCES", "GRPO_SCOPES", "MODES", "WEIGHTINGS", "CreditConfig", "WholeBatch"]

MODES = ("adaptive", "turn", "token", "random")
WEIGHTINGS = ("legacy", "bounded")
DISTANCES = ("jsd", "entropy", "cosine")
GRPO_SCOPES = ("trajectory", "turn")


@dataclass
@dataclass
class CreditConfig:
    """Settings of Mechanism 2 (defaults: ALGORITHM.md §5, common to the paper's profiles)."""

    mode: str = "adaptive"
    """Ablation mode: "adaptive" (E, full method), "turn" (C, one span per trajectory), "token" (B, flat
    token-level credit, no eta mixing), "random" (D, random spans seeded by trajectory index)."""
    weighting: str = "legacy"
    """Box of the projected density x: "legacy" = [0, density_upper_bound]; "bounded" = 1 -/+ multiplier_band."""
    credit_temperature: float = 0.5
    """T_c > 0: temperature of the span and within-span budgets (softmax of log N + S / T_c)."""
    mixing: float = 0.5
    """eta in [0, 1]: turn weight w = (1 - eta) + eta * x (not applied in mode "token")."""
    density_upper_bound: float = 4.0
    """h_max >= 1: upper bound of x in legacy weighting."""
    multiplier_band: float = 0.2
    """band in [0, 1]: bounded weighting keeps x in [1 - band, 1 + band]."""
    profile_temperature: float = 0.1
    """T_p >= 1e-6: temperature of the correspondence profiles softmax(H[s, t] / T_p)."""
    quantile: float = 0.8
    """q in [0, 1]: the segmentation threshold is the q-quantile of valid adjacent distances (linear)."""
    tau_min: float = 0.01
    """Lower clip of the threshold, and the minimum distance of a correspondence-guided fallback boundary."""
    tau_max: float = 0.10
    """Upper clip of the threshold (tau_max >= tau_min)."""
    min_span_turns: int = 2
    """L_min >= 1: minimum span length in turns (a trajectory shorter than this is one short span)."""
    max_span_turns: int = 8
    """L_max >= 2 * L_min - 1: maximum span length; longer gaps are repaired (guided, else forced)."""
    gamma: float = 0.8
    """The Mechanism-1 similarity threshold; a profile is valid iff its best eligible H >= gamma."""
    distance: str = "jsd"
    """Adjacent-profile distance: "jsd" (JS divergence / ln 2), "entropy" (|H(p)-H(q)| / ln M), "cosine"."""
    grpo_scope: str = "turn"
    """Outcome-advantage statistics over "trajectory" (each once) or "turn" (weighted by turn count)."""
    norm_by_std: bool = True
    """Divide the centred outcome by (unbiased std + 1e-6)."""
    invalid_penalty: float = 0.1
    """c >= 0 of the invalid-action residual (§3.10), added after allocation; 0 disables it."""
    seed: int = 0
    """Base seed of mode "random": trajectory j (sorted (task, rollout) order) uses Random(seed + j)."""
    impl: str = "auto"
    """Segmentation/projection implementation: "auto" (C++ if built), "python" or "cpp"."""

    def __post_init__(self) -> None:
        check_choice(self.mode, "mode", MODES)
        check_choice(self.weighting, "weighting", WEIGHTINGS)
        check_choice(self.distance, "distance", DISTANCES)
        check_choice(self.grpo_scope, "grpo_scope", GRPO_SCOPES)
        check_choice(self.impl, "impl", _native.IMPLS)
        self.credit_temperature = check_real(self.credit_temperature, "credit_temperature")
        if self.credit_temperature <= 0:
            raise ValueError(f"credit_temperature: must be > 0, got {self.credit_temperature}")
        self.mixing = check_real(self.mixing, "mixing", lo=0.0, hi=1.0)
        self.density_upper_bound = check_real(self.density_upper_bound, "density_upper_bound", lo=1.0)
        self.multiplier_band = check_real(self.multiplier_band, "multiplier_band", lo=0.0, hi=1.0)
        self.profile_temperature = check_real(self.profile_temperature, "profile_temperature")
        if self.profile_temperature < 1e-6:
            raise ValueError(f"profile_temperature: must be >= 1e-6, got {self.profile_temperature}")
        self.quantile = check_real(self.quantile, "quantile", lo=0.0, hi=1.0)
        self.tau_min = check_real(self.tau_min, "tau_min")
        self.tau_max = check_real(self.tau_max, "tau_max")
        if self.tau_max < self.tau_min:
            raise ValueError(f"tau_max: must be >= tau_min = {self.tau_min}, got {self.tau_max}")
        for name in ("min_span_turns", "max_span_turns", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
        if self.min_span_turns < 1:
            raise ValueError(f"min_span_turns: must be >= 1, got {self.min_span_turns}")
        if self.max_span_turns < 2 * self.min_span_turns - 1:
            raise ValueError(
                f"max_span_turns: must be >= 2 * min_span_turns - 1 = {2 * self.min_span_turns - 1}, "
                f"got {self.max_span_turns}"
            )
        self.gamma = check_real(self.gamma, "gamma")
        if not isinstance(self.norm_by_std, bool):
            raise ValueError(f"norm_by_std: expected a bool, got {type(self.norm_by_std).__name__}")
        self.invalid_penalty = check_real(self.invalid_penalty, "invalid_penalty", lo=0.0)

    @property
    def uses_distances(self) -> bool:
        """The mode computes profiles, adjacent distances and the threshold (§3.2-§3.4): "adaptive" and "random"
        (which keeps them for its diagnostics and the repair's guided fallback); "turn" and "token" do not."""
        return self.mode in ("adaptive", "random")

    @property
    def box(self) -> tuple[float, float]:
        """(lo, hi) of the projected density x."""
        if self.weighting == "legacy":
            return 0.0, self.density_upper_bound
        return 1.0 - self.multiplier_band, 1.0 + self.multiplier_band


def _count(v, name: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    return v


@dataclass(frozen=True)
class WholeBatch:
    """The whole batch's statistics, for a Mechanism 2 call that sees only one share of the batch.

    Under data parallelism every rank holds whole tasks of the step's batch (all rollouts of a task on one rank),
    so the per-task and per-trajectory rules of §3 need nothing from the other ranks; these are the quantities
    §3 takes over the whole batch. The engine gathers them over the ranks and passes them in; with them a share
    gets exactly (bit for bit) the spans, budgets and token advantages its turns get when the whole batch is
    allocated in one call. The shares must be in identity order across the ranks (every task of a lower rank
    sorts before the tasks of a higher rank).

    turns: M of the whole batch, the normaliser ln M of the "entropy" distance (§3.3).
    block_width: turns of the whole batch's largest task: the width of the task blocks the profile and distance
        sums run over (rows padded to another width sum in another order and differ in the last bits).
    trajectory_offset: trajectories of the whole batch before this share in sorted (task, rollout) order; mode
        "random" (ablation D) seeds trajectory j of the share with Random(seed + trajectory_offset + j) (§3.11).
    threshold: tau of §3.4 over the valid adjacent distances of the whole batch (``segmentation_threshold`` of
        the distances gathered from every share, each from ``profiles.valid_distances``); math.inf when none is
        valid. None: not known yet (what ``valid_distances`` is given); ``allocate_credit`` requires it in the
        modes that segment ("adaptive", "random").
    """

    turns: int
    block_width: int
    trajectory_offset: int = 0
    threshold: float | None = None

    def __post_init__(self) -> None:
        _count(self.turns, "whole_batch.turns", 1)
        _count(self.block_width, "whole_batch.block_width", 1)
        _count(self.trajectory_offset, "whole_batch.trajectory_offset", 0)
        tau = self.threshold
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or math.isnan(tau)):
            raise ValueError(f"whole_batch.threshold: expected a real number, math.inf or None, got {tau!r}")
        if self.block_width > self.turns:
            raise ValueError(
                f"whole_batch.block_width: {self.block_width} exceeds the whole batch's {self.turns} turns"
            )

    def check_share(self, *, turns: int, width: int) -> None:
        """ValueError naming the field when a share of ``turns`` turns, ``width`` of them in its largest task,
        cannot be part of this whole batch."""
        if turns > self.turns:
            raise ValueError(f"whole_batch.turns: {self.turns} is fewer than this share's {turns} turns")
        if width > self.block_width:
            raise ValueError(
                f"whole_batch.block_width: {self.block_width} is smaller than this share's largest task ({width} turns)"
            )

    def check_threshold(self, config: CreditConfig) -> None:
        """ValueError naming ``whole_batch.threshold`` when it is missing in a mode that segments, or is not a
        threshold of ``config`` (math.inf, or clipped to [tau_min, tau_max])."""
        tau = self.threshold
        if config.uses_distances and tau is None:
            raise ValueError(
                f"whole_batch.threshold: required in mode {config.mode!r} (tau is the quantile over the whole "
                "batch's valid distances)"
            )
        if tau is not None and tau != math.inf and not config.tau_min <= tau <= config.tau_max:
            raise ValueError(
                f"whole_batch.threshold: {tau} is neither math.inf nor inside [tau_min, tau_max] = "
                f"[{config.tau_min}, {config.tau_max}]"
            )

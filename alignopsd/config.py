"""Typed algorithm configuration and the paper's profiles as presets.

Every config is a dataclass validated in ``__post_init__`` (ValueError naming the field); each
field carries a docstring. The strict generic loader lives in ``alignopsd.config_loader`` and is
re-exported here: :func:`from_dict` builds nested dataclasses from plain mappings and rejects
unknown keys; :func:`apply_overrides` applies ``a.b=c`` overrides (values parsed as YAML scalars,
never executed). No file I/O here: the engine reads YAML files.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from alignopsd.algorithm_sections import AlignmentLossConfig, OpsdConfig, RectifyConfig, RlsdConfig, SdarConfig
from alignopsd.config_loader import apply_overrides, from_dict, override_mapping, to_dict
from alignopsd.config_values import bool_field, choice_field, real_field
from alignopsd.credit_config import CreditConfig
from alignopsd.estimators import ESTIMATOR_SECTIONS, ESTIMATORS

__all__ = [
    "ABLATIONS",
    "ABLATION_CREDIT_MODE",
    "AlgorithmConfig",
    "AlignmentLossConfig",
    "OpsdConfig",
    "PRESETS",
    "RectifyConfig",
    "RlsdConfig",
    "SdarConfig",
    "apply_overrides",
    "from_dict",
    "get_preset",
    "override_mapping",
    "to_dict",
]

ABLATIONS = ("A", "B", "C", "D", "E")
ABLATION_CREDIT_MODE = {"A": "adaptive", "B": "token", "C": "turn", "D": "random", "E": "adaptive"}
"""Credit (M2) segmentation mode implied by each ablation of ALGORITHM.md §3.11 (A also sets α_max = 0)."""


# Fields of CreditConfig that the algorithm config owns (credit field -> algorithm attribute path).
_CREDIT_SYNC: dict[str, str] = {
    "gamma": "rectify.gamma",
    "grpo_scope": "grpo_scope",
    "norm_by_std": "norm_by_std",
    "invalid_penalty": "invalid_penalty",
    "mode": "ablation",
}


def _getpath(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


@functools.cache
def _sections(cls: type) -> dict[str, type]:
    """The config sections of ``cls`` (field name -> its dataclass), read from its annotations: a section added
    as a field is checked without a list kept by hand."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


@dataclass
class AlgorithmConfig:
    """The algorithm side of a run: estimator, M1, M2 and loss settings (ALGORITHM.md §2, §3, §5).

    ``credit.gamma``, ``credit.grpo_scope``, ``credit.norm_by_std``, ``credit.invalid_penalty`` and
    ``credit.mode`` are derived from ``rectify.gamma``, ``grpo_scope``, ``norm_by_std``, ``invalid_penalty``
    and ``ablation``; setting them explicitly to a different value is an error.
    """

    estimator: str = "alignopsd"
    """Advantage estimator from the registry (alignopsd.estimators): grpo, opsd, grpo_opsd, sdar, rlsd,
    alignopsd, alignopsd_m1, or a user-registered name."""
    ablation: Literal["A", "B", "C", "D", "E"] = "E"
    """AlignOPSD ablation (§3.11): A no rectification, B flat token, C flat turn, D random spans, E full.
    The M1-only consumer (``alignopsd_m1``) honours only A (α_max = 0); B–D act on Mechanism 2."""
    rectify: RectifyConfig = field(default_factory=RectifyConfig)
    """Mechanism 1 settings."""
    credit: CreditConfig = field(default_factory=CreditConfig)
    """Mechanism 2 settings (alignopsd.credit_config.CreditConfig)."""
    mechanism2_enabled: bool | None = None
    """Whether Mechanism 2 credit runs; None derives it from the estimator. It must match what the consumer
    declares (``uses_mechanism2`` in its registration: true for ``alignopsd``)."""
    alignment: AlignmentLossConfig = field(default_factory=AlignmentLossConfig)
    """M1-only alignment loss (``alignopsd_m1``)."""
    sdar: SdarConfig = field(default_factory=SdarConfig)
    """SDAR auxiliary (optional for ``alignopsd``; always on for ``sdar``)."""
    rlsd: RlsdConfig = field(default_factory=RlsdConfig)
    """RLSD baseline settings."""
    opsd: OpsdConfig = field(default_factory=OpsdConfig)
    """OPSD baselines settings."""
    grpo_scope: Literal["trajectory", "turn"] = "turn"
    """Outcome-advantage statistics: each trajectory once, or weighted by its turn count (§3.1)."""
    norm_by_std: bool = True
    """Divide the centred outcome by (unbiased std + 1e-6)."""
    use_invalid_penalty: bool = True
    """Apply the invalid-action penalty (residual for M2 consumers, in the reward for alignopsd_m1)."""
    invalid_penalty: float = 0.1
    """c: penalty per invalid action (0.1 ALFWorld/WebShop, 0.01 Search) (>= 0)."""
    kl_coef: float = 0.01
    """Coefficient of the k3 KL loss to the reference policy; 0 skips the reference pass."""
    entropy_coef: float = 0.001
    """Entropy bonus coefficient (the framework default, active in every paper run)."""
    clip_low: float = 0.2
    """PPO clip ε_low."""
    clip_high: float = 0.2
    """PPO clip ε_high."""
    dual_clip: float = 3.0
    """Dual-clip constant c (> 1) for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation; the method requires 'token-mean' (with 1/k row weights)."""
    registered: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Sections of estimators registered with ``settings=`` (section key -> its dataclass instance), read and written
    as ``algorithm.<key>``; the run's estimator's own section is always present (its defaults when not given)."""

    @staticmethod
    def _registered_sections() -> dict[str, type]:
        return dict(ESTIMATOR_SECTIONS)

    def section(self, name: str) -> Any:
        """A config section by its key: a field of this class or a registered estimator's (``settings=``)."""
        if name in _sections(type(self)):
            return getattr(self, name)
        if name not in self.registered:
            known = [*_sections(type(self)), *self.registered]
            raise ValueError(f"section: no config section {name!r}; this config has {', '.join(known)}")
        return self.registered[name]

    _DERIVED: typing.ClassVar[dict[str, str]] = {
        **{f"credit.{k}": v for k, v in _CREDIT_SYNC.items()},
        "mechanism2_enabled": "estimator",
    }
    """Fields computed from others: :func:`to_dict` leaves them out (explicit values are still checked)."""

    def __post_init__(self) -> None:
        if not isinstance(self.estimator, str) or self.estimator not in ESTIMATORS:
            allowed = ", ".join(map(repr, ESTIMATORS))
            raise ValueError(f"estimator: unknown value {self.estimator!r}; allowed: {allowed}")
        choice_field("ablation", self.ablation, ABLATIONS)
        for name, cls in _sections(type(self)).items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name}: expected {cls.__name__}, got {type(getattr(self, name)).__name__}")
        choice_field("grpo_scope", self.grpo_scope, ("trajectory", "turn"))
        bool_field("norm_by_std", self.norm_by_std)
        bool_field("use_invalid_penalty", self.use_invalid_penalty)
        real_field("invalid_penalty", self.invalid_penalty, lo=0.0)
        real_field("kl_coef", self.kl_coef, lo=0.0)
        real_field("entropy_coef", self.entropy_coef, lo=0.0)
        real_field("clip_low", self.clip_low, lo=0.0, hi=1.0)
        real_field("clip_high", self.clip_high, lo=0.0)
        real_field("dual_clip", self.dual_clip, lo=1.0, lo_open=True)
        if self.loss_agg_mode != "token-mean":
            raise ValueError(f"loss_agg_mode: must be 'token-mean' (§3.12), got {self.loss_agg_mode!r}")
        own = ESTIMATORS[self.estimator].section
        if own is not None and own not in self.registered:  # the run's estimator's section, at its defaults
            self.registered[own] = ESTIMATOR_SECTIONS[own]()
        consumer_m2 = ESTIMATORS[self.estimator].mechanism2
        if self.mechanism2_enabled is None:
            self.mechanism2_enabled = consumer_m2
        bool_field("mechanism2_enabled", self.mechanism2_enabled)
        if self.mechanism2_enabled != consumer_m2:
            raise ValueError(
                f"mechanism2_enabled: {self.mechanism2_enabled} does not match the consumer estimator "
                f"{self.estimator!r} (Mechanism 2 runs exactly for the estimators that declare it: "
                f"{', '.join(repr(n) for n, spec in ESTIMATORS.items() if spec.mechanism2)})"
            )
        # derived credit fields
        updates = {}
        for key, src in _CREDIT_SYNC.items():
            value = _getpath(self, src)
            if key == "mode":
                value = ABLATION_CREDIT_MODE[value]
            if getattr(self.credit, key) != value:
                updates[key] = value
        if updates:
            self.credit = dataclasses.replace(self.credit, **updates)

    @property
    def effective_alpha_max(self) -> float:
        """α_max actually used by Mechanism 1: 0 under ablation A (§3.11), for both consumers
        (``alignopsd`` and ``alignopsd_m1``: "when the consumer is M1-only, only A has any effect")."""
        if self.ablation == "A":
            return 0.0
        return self.rectify.alpha_max

    @classmethod
    def _check_derived(cls, data: dict, path: str) -> None:
        """Reject explicit credit.* values that contradict their owner (called by :func:`from_dict`)."""
        credit = data.get("credit")
        if not isinstance(credit, dict):
            return
        for key, src in _CREDIT_SYNC.items():
            if key not in credit:
                continue
            owner = _lookup_with_default(cls, data, src)
            expected = ABLATION_CREDIT_MODE.get(owner, owner) if key == "mode" else owner
            if credit[key] != expected:
                where = f"{path}." if path else ""
                raise ValueError(
                    f"{where}credit.{key}: {credit[key]!r} contradicts {where}{src} = {owner!r}; "
                    f"credit.{key} is derived from {src}: set {where}{src} and drop {where}credit.{key}"
                )


def _lookup_with_default(cls: type, data: dict, dotted: str) -> Any:
    """Value of ``dotted`` in raw ``data``, else the dataclass default along that path."""
    parts = dotted.split(".")
    node: Any = data
    tp: Any = cls
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
            if i == len(parts) - 1:
                return node
            tp = typing.get_type_hints(tp)[part]
            continue
        # fall back to defaults from here
        f = {f.name: f for f in dataclasses.fields(tp)}[part]
        val = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        for rest in parts[i + 1 :]:
            val = getattr(val, rest)
        return val
    return node


# ---------------------------------------------------------------------------------------------------------- presets


def _profile(
    *,
    gamma: float,
    top_k: int,
    alpha_max: float,
    mode: str,
    credit_temperature: float,
    grpo_scope: str,
    sdar: bool,
    action_filter: bool,
    kl_coef: float,
    invalid_penalty: float,
) -> AlgorithmConfig:
    return AlgorithmConfig(
        estimator="alignopsd",
        ablation="E",
        rectify=RectifyConfig(
            gamma=gamma, top_k=top_k, alpha_max=alpha_max, mode=mode, action_filter=action_filter, action_threshold=0.8
        ),
        credit=CreditConfig(credit_temperature=credit_temperature),
        sdar=SdarConfig(enabled=sdar, coef=0.01, beta=5.0),
        grpo_scope=grpo_scope,
        invalid_penalty=invalid_penalty,
        kl_coef=kl_coef,
    )


def _m1_profile(*, kl_coef: float, invalid_penalty: float) -> AlgorithmConfig:
    return AlgorithmConfig(
        estimator="alignopsd_m1",
        rectify=RectifyConfig(gamma=0.70, top_k=3, alpha_max=0.20, temperature=0.10, mode="probability_mixture"),
        alignment=AlignmentLossConfig(coef=0.01, beta=5.0),
        invalid_penalty=invalid_penalty,
        kl_coef=kl_coef,
    )


PRESETS: dict[str, typing.Callable[[], AlgorithmConfig]] = {
    # ALGORITHM.md §5, main AlignOPSD runs
    "alfworld_3b": lambda: _profile(
        gamma=0.65,
        top_k=2,
        alpha_max=0.8,
        mode="probability_mixture",
        credit_temperature=0.5,
        grpo_scope="turn",
        sdar=True,
        action_filter=True,
        kl_coef=0.01,
        invalid_penalty=0.1,
    ),
    "alfworld_7b": lambda: _profile(
        gamma=0.80,
        top_k=3,
        alpha_max=0.8,
        mode="probability_mixture",
        credit_temperature=0.5,
        grpo_scope="turn",
        sdar=False,
        action_filter=False,
        kl_coef=0.01,
        invalid_penalty=0.1,
    ),
    "webshop_3b": lambda: _profile(
        gamma=0.80,
        top_k=3,
        alpha_max=0.8,
        mode="probability_mixture",
        credit_temperature=0.2,
        grpo_scope="turn",
        sdar=False,
        action_filter=True,
        kl_coef=0.01,
        invalid_penalty=0.1,
    ),
    "webshop_7b": lambda: _profile(
        gamma=0.80,
        top_k=2,
        alpha_max=0.8,
        mode="probability_mixture",
        credit_temperature=0.5,
        grpo_scope="turn",
        sdar=False,
        action_filter=False,
        kl_coef=0.01,
        invalid_penalty=0.1,
    ),
    "search_3b": lambda: _profile(
        gamma=0.70,
        top_k=3,
        alpha_max=0.2,
        mode="log_mean",
        credit_temperature=1.0,
        grpo_scope="trajectory",
        sdar=False,
        action_filter=False,
        kl_coef=0.001,
        invalid_penalty=0.01,
    ),
    "search_7b": lambda: _profile(
        gamma=0.70,
        top_k=3,
        alpha_max=0.8,
        mode="probability_mixture",
        credit_temperature=0.5,
        grpo_scope="turn",
        sdar=False,
        action_filter=False,
        kl_coef=0.001,
        invalid_penalty=0.01,
    ),
    # M1-only launchers
    "m1_alfworld": lambda: _m1_profile(kl_coef=0.01, invalid_penalty=0.1),
    "m1_webshop": lambda: _m1_profile(kl_coef=0.01, invalid_penalty=0.1),
    "m1_search": lambda: _m1_profile(kl_coef=0.001, invalid_penalty=0.01),
}
"""Named presets: a zero-argument factory per profile returning a fresh AlgorithmConfig."""


def get_preset(name: str) -> AlgorithmConfig:
    """A fresh AlgorithmConfig of the named profile (ValueError listing the names if unknown)."""
    if name not in PRESETS:
        raise ValueError(f"name: unknown preset {name!r}; allowed: {', '.join(map(repr, PRESETS))}")
    return PRESETS[name]()

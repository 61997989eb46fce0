"""Typed algorithm configuration and the paper's profiles as presets.

Every config is a dataclass validated in ``__post_init__`` (ValueError naming the field); each
field carries a docstring. The strict generic loader lives in ``alignopsd.config_loader`` and is
re-exported here: :func:`from_dict` builds nested dataclasses from plain mappings and rejects
unknown keys; :func:`apply_overrides` applies ``a.b=c`` overrides (values parsed as YAML scalars,
never executed). No file I/O here: the engine reads YAML files.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from alignopsd.algorithm_sections import AlignmentLossConfig, OpsdConfig, RectifyConfig, RlsdConfig, SdarConfig
from alignopsd.config_loader import apply_overrides, from_dict, override_mapping, to_dict
from alignopsd.config_values import bool_field, choice_field, real_field
from alignopsd.credit_config import CreditConfig
from alignopsd.estimators import BUILTIN_ESTIMATORS, ESTIMATOR_SECTIONS, ESTIMATORS

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


def _always_present() -> set[str]:
    """Keys of the sections in every config: those of the method's own estimators (every stored config has them)."""
    return {k for name, spec in ESTIMATORS.items() if name in BUILTIN_ESTIMATORS for k in spec.sections}


@dataclass(init=False)
class AlgorithmConfig:
    """The algorithm side of a run: estimator, M1, M2 and loss settings (ALGORITHM.md §2, §3, §5).

    Sections: each estimator registers the settings it reads (``register_estimator(..., settings=...)``,
    alignopsd.estimators): the built-in ones ``rectify`` (Mechanism 1, :class:`RectifyConfig`), ``credit``
    (Mechanism 2, ``CreditConfig``), ``alignment`` (the M1-only loss, ``alignopsd_m1``), ``sdar`` (the SDAR auxiliary:
    always on for ``sdar``, optional for ``alignopsd``), ``rlsd`` and ``opsd`` (baselines); a user estimator its own.
    A section is given as a keyword (``AlgorithmConfig(rectify=RectifyConfig(gamma=0.8))``) or as ``algorithm.<key>``
    in a mapping, and read as ``config.section(key)``; the built-in ones also as typed attributes (``config.rectify``,
    ``config.credit``, ``config.alignment``, ``config.sdar``, ``config.rlsd``, ``config.opsd``; assigning one replaces
    the section). The built-in estimators' sections are in
    every config, at their defaults when not given; another estimator's section is in the configs that give it or run
    that estimator (so a config stored by a run that does not use it loads where that estimator is not registered).

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
    mechanism2_enabled: bool | None = None
    """Whether Mechanism 2 credit runs; None derives it from the estimator. It must match what the consumer
    declares (``uses_mechanism2`` in its registration: true for ``alignopsd``)."""
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
    registered: dict[str, Any] = field(default_factory=dict)
    """The config's sections (section key -> its dataclass instance), in the registry's order. Not a config key:
    each section is one (``algorithm.<key>``); given here (as ``dataclasses.replace`` does) or by key."""

    def __init__(self, **values: Any) -> None:
        """Fields and sections by name: a dataclass's generated ``__init__``, plus each registered section by its key
        (over the same key in ``registered``)."""
        names = [f.name for f in dataclasses.fields(self) if f.init]
        unknown = [k for k in values if k not in names and k not in ESTIMATOR_SECTIONS]
        if unknown:
            raise TypeError(f"AlgorithmConfig() got an unexpected keyword argument {unknown[0]!r}")
        sections = dict(values.pop("registered", {}))
        for f in dataclasses.fields(self):
            if f.name != "registered":
                object.__setattr__(self, f.name, values.pop(f.name, f.default))
        object.__setattr__(self, "registered", {**sections, **values})
        self.__post_init__()

    @staticmethod
    def _registered_sections() -> dict[str, type]:
        return dict(ESTIMATOR_SECTIONS)

    def section(self, name: str) -> Any:
        """A config section by its key (registered with an estimator: ``settings=``)."""
        if name not in self.registered:
            raise ValueError(f"section: no config section {name!r}; this config has {', '.join(self.registered)}")
        return self.registered[name]

    def _set_section(self, name: str, value: Any) -> None:
        """A section assigned as an attribute is one of the config's sections (checked like a given one)."""
        if not isinstance(value, ESTIMATOR_SECTIONS[name]):
            raise ValueError(f"{name}: expected {ESTIMATOR_SECTIONS[name].__name__}, got {type(value).__name__}")
        sections = {**self.registered, name: value}
        self.registered = {k: sections[k] for k in ESTIMATOR_SECTIONS if k in sections}

    # The built-in estimators' sections (in every config), typed; a plug-in's is ``section(key)``.

    @property
    def rectify(self) -> RectifyConfig:
        """Mechanism 1 (``algorithm.rectify``): read by ``alignopsd`` and ``alignopsd_m1``."""
        return self.section("rectify")

    @rectify.setter
    def rectify(self, value: RectifyConfig) -> None:
        self._set_section("rectify", value)

    @property
    def credit(self) -> CreditConfig:
        """Mechanism 2 (``algorithm.credit``): read by ``alignopsd``; its derived fields follow their owners."""
        return self.section("credit")

    @credit.setter
    def credit(self, value: CreditConfig) -> None:
        self._set_section("credit", value)

    @property
    def alignment(self) -> AlignmentLossConfig:
        """The M1-only alignment loss (``algorithm.alignment``): read by ``alignopsd_m1``."""
        return self.section("alignment")

    @alignment.setter
    def alignment(self, value: AlignmentLossConfig) -> None:
        self._set_section("alignment", value)

    @property
    def sdar(self) -> SdarConfig:
        """The SDAR auxiliary (``algorithm.sdar``): read by ``sdar`` and ``alignopsd``."""
        return self.section("sdar")

    @sdar.setter
    def sdar(self, value: SdarConfig) -> None:
        self._set_section("sdar", value)

    @property
    def rlsd(self) -> RlsdConfig:
        """The RLSD baseline (``algorithm.rlsd``)."""
        return self.section("rlsd")

    @rlsd.setter
    def rlsd(self, value: RlsdConfig) -> None:
        self._set_section("rlsd", value)

    @property
    def opsd(self) -> OpsdConfig:
        """The self-distillation baselines (``algorithm.opsd``): read by ``opsd`` and ``grpo_opsd``."""
        return self.section("opsd")

    @opsd.setter
    def opsd(self, value: OpsdConfig) -> None:
        self._set_section("opsd", value)

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
        self._fill_sections()
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
        self._derive_credit()

    def _fill_sections(self) -> None:
        """The sections given, the run's estimator's and the built-in estimators' (at their defaults when not
        given), each checked against its registered dataclass, in the registry's order."""
        present = set(self.registered) | set(ESTIMATORS[self.estimator].sections) | _always_present()
        for name in present:
            cls = ESTIMATOR_SECTIONS[name]
            value = self.registered.get(name)
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"{name}: expected {cls.__name__}, got {type(value).__name__}")
        given = self.registered
        self.registered = {k: given[k] if k in given else c() for k, c in ESTIMATOR_SECTIONS.items() if k in present}

    def _derive_credit(self) -> None:
        """Mechanism 2's fields that the method-wide settings own (``_CREDIT_SYNC``)."""
        if "credit" not in self.registered:
            return
        updates = {}
        for key, src in _CREDIT_SYNC.items():
            value = _getpath(self, src)
            if key == "mode":
                value = ABLATION_CREDIT_MODE[value]
            if getattr(self.registered["credit"], key) != value:
                updates[key] = value
        if updates:
            self.registered["credit"] = dataclasses.replace(self.registered["credit"], **updates)

    @property
    def effective_alpha_max(self) -> float:
        """α_max actually used by Mechanism 1: 0 under ablation A (§3.11), for both consumers
        (``alignopsd`` and ``alignopsd_m1``: "when the consumer is M1-only, only A has any effect")."""
        if self.ablation == "A":
            return 0.0
        return self.section("rectify").alpha_max

    @classmethod
    def _check_derived(cls, data: dict, path: str) -> None:
        """Reject explicit credit.* values that contradict their owner (called by :func:`from_dict`)."""
        credit = data.get("credit")
        if not isinstance(credit, dict):
            return
        for key, src in _CREDIT_SYNC.items():
            if key not in credit:
                continue
            owner = _value_or_default(cls, data, src)
            expected = ABLATION_CREDIT_MODE.get(owner, owner) if key == "mode" else owner
            if credit[key] != expected:
                where = f"{path}." if path else ""
                raise ValueError(
                    f"{where}credit.{key}: {credit[key]!r} contradicts {where}{src} = {owner!r}; "
                    f"credit.{key} is derived from {src}: set {where}{src} and drop {where}credit.{key}"
                )


def _value_or_default(cls: type, data: dict, dotted: str) -> Any:
    """Value of ``dotted`` (a field, or ``section.field``) in raw ``data``, else its default: the field's, or the
    registered section dataclass's."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return data[head] if head in data else {f.name: f for f in dataclasses.fields(cls)}[head].default
    section = data.get(head)
    if isinstance(section, dict) and rest in section:
        return section[rest]
    return _getpath(ESTIMATOR_SECTIONS[head](), rest)


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

"""Advantage estimators: a registry in the style of verl's ``core_algos.py``.

Legend: M = canonical turns, L = response length, P = kept M1 pairs.

Each estimator maps :class:`EstimatorInputs` (the step's tensors on canonical turns) and an
``AlgorithmConfig`` to :class:`EstimatorOutput`: token advantages [M, L] (exactly 0 outside the
policy mask), the auxiliary loss terms the actor must add (:class:`alignopsd.losses.AuxTerm`, with
frozen tensors), and metrics; both types live in :mod:`alignopsd.estimator_io` and are re-exported here.
Its :class:`EstimatorSpec` declares which model phases the step must run (``needs_teacher_diag``: diagonal
teacher forcing; ``needs_alignment``: teacher generation + encoder + cross scoring; ``needs_ref``: reference
log-probs, i.e. ``kl_coef > 0``), so that the trainer runs only what an estimator uses (GRPO runs no teacher
pass).

Registered: ``grpo``, ``opsd``, ``grpo_opsd``, ``sdar``, ``rlsd``, ``alignopsd`` (ablations A–E),
``alignopsd_m1``, each with the config sections it reads (``settings=``, the way any estimator gives itself settings:
``sdar``; ``opsd`` (shared by ``opsd`` and ``grpo_opsd``); ``rlsd``; ``rectify`` (Mechanism 1, shared by both
AlignOPSD consumers), ``credit`` (Mechanism 2) and ``sdar`` (its optional auxiliary) for ``alignopsd``; ``rectify``
and ``alignment`` for ``alignopsd_m1``), read as ``config.section(key)``. Outcome-based estimators share the outcome
advantage of ALGORITHM.md §3.1 plus the invalid-action residual of §3.10 (``grpo`` is therefore exactly AlignOPSD with
w ≡ 1), except ``alignopsd_m1``, which uses verl-agent GRPO over all rows with the penalty in the reward (§2.9).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from alignopsd._checks import check_real
from alignopsd.advantage import grpo_advantage, invalid_action_residual, rowwise_grpo_advantage
from alignopsd.algorithm_sections import (
    AlignmentLossConfig,
    EstimatorConfig,
    OpsdConfig,
    RectifyConfig,
    RlsdConfig,
    SdarConfig,
)
from alignopsd.credit import allocate_credit
from alignopsd.credit_config import CreditConfig
from alignopsd.diagnostics import m1_diagnostics
from alignopsd.estimator_io import EstimatorInputs, EstimatorOutput
from alignopsd.losses import AuxTerm
from alignopsd.rectification import Rectified, rectify
from alignopsd.reduction import same, weighted_mean

__all__ = [
    "ESTIMATORS",
    "ESTIMATOR_SECTIONS",
    "EstimatorInputs",
    "EstimatorName",
    "EstimatorOutput",
    "EstimatorPhases",
    "EstimatorSpec",
    "get_estimator",
    "outcome_advantage",
    "rectify_inputs",
    "register_estimator",
    "rlsd_lambda",
    "rowwise_grpo_advantage",
]


class EstimatorName(str, enum.Enum):
    """Names of the built-in estimators."""

    GRPO = "grpo"
    OPSD = "opsd"
    GRPO_OPSD = "grpo_opsd"
    SDAR = "sdar"
    RLSD = "rlsd"
    ALIGNOPSD = "alignopsd"
    ALIGNOPSD_M1 = "alignopsd_m1"


EstimatorFn = Callable[[EstimatorInputs, EstimatorConfig], EstimatorOutput]
"""``fn(inputs, config)``: config is the run's ``alignopsd.config.AlgorithmConfig``."""

Need = bool | Callable[[EstimatorConfig], bool]
"""A declared need: a fixed answer, or a function of the AlgorithmConfig (``cfg.section("sdar").enabled``)."""


def _answer(need: Need, config: EstimatorConfig) -> bool:
    return bool(need(config)) if callable(need) else need


def _check_need(need: Any, name: str) -> Need:
    if not (isinstance(need, bool) or callable(need)):
        raise ValueError(f"{name}: expected a bool or a function of the AlgorithmConfig, got {need!r}")
    return need


@dataclass(frozen=True)
class EstimatorPhases:
    """The step phases an estimator needs under a config (:meth:`EstimatorSpec.phases`).

    teacher_diag: diagonal teacher forcing; alignment: teacher generation, encoder, selection and cross scoring
    (Mechanism 1); ref: reference log-probs (the KL term); mechanism2: Mechanism 2 credit.
    """

    teacher_diag: bool
    alignment: bool
    ref: bool
    mechanism2: bool


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator: its function and what it declares it needs.

    teacher_diag: diagonal teacher forcing ℓ^diag (implied by ``alignment``); alignment: teacher generation,
    encoder, selection and cross scoring (Mechanism 1); mechanism2: Mechanism 2 credit; aux: it adds
    auxiliary loss terms; outcome_scaled: its token advantage is the outcome advantage A (plus the invalid
    residual) times non-negative weights, so a task whose outcomes (and, with the penalty on, validity flags)
    are all equal gets exactly zero advantage; loss_separable: the actor loss it makes (PPO on its token
    advantage, plus its auxiliary terms) is a sum of per-token terms of the log-probs and entropies, which the
    fused head loss requires (a loss with a sequence-level ratio, or a normaliser computed from log-probs, is
    not, and trains through autograd instead). ``teacher_diag`` and ``aux`` may depend on the config.
    sections: the keys of the config sections it reads (``settings=`` of its registration).
    """

    name: str
    fn: EstimatorFn
    teacher_diag: Need
    alignment: bool
    mechanism2: bool
    aux: Need
    outcome_scaled: bool
    description: str
    loss_separable: bool = True
    sections: tuple[str, ...] = ()

    def needs_teacher_diag(self, config: EstimatorConfig) -> bool:
        """Diagonal teacher log-probs are needed (always with alignment)."""
        return self.alignment or _answer(self.teacher_diag, config)

    def has_aux(self, config: EstimatorConfig) -> bool:
        """The estimator adds auxiliary loss terms under ``config``."""
        return _answer(self.aux, config)

    def needs_ref(self, config: EstimatorConfig) -> bool:
        """Reference log-probs are needed iff the KL term is on."""
        return float(config.kl_coef) > 0.0

    def phases(self, config: EstimatorConfig) -> EstimatorPhases:
        """The step phases to run under ``config``."""
        return EstimatorPhases(
            teacher_diag=self.needs_teacher_diag(config),
            alignment=self.alignment,
            ref=self.needs_ref(config),
            mechanism2=self.mechanism2,
        )

    def __call__(self, inputs: EstimatorInputs, config: EstimatorConfig) -> EstimatorOutput:
        return self.fn(inputs, config)


ESTIMATORS: dict[str, EstimatorSpec] = {}

ESTIMATOR_SECTIONS: dict[str, type] = {}
"""Config sections registered with an estimator (``settings=``): section key -> its dataclass, in the order they were
first registered. The algorithm config (``alignopsd.config.AlgorithmConfig``) reads and writes them under
``algorithm.<key>``; an estimator reads its own with ``config.section(key)``. A section may be registered by several
estimators (``rectify`` by both AlignOPSD consumers), always with the same dataclass."""

BUILTIN_ESTIMATORS = frozenset(e.value for e in EstimatorName)
"""The method's own estimators: their sections are part of every algorithm config (see AlgorithmConfig)."""


def _settings_sections(settings: Any, section: str | None, key: str) -> dict[str, type]:
    """The sections ``settings=`` declares (key -> dataclass), checked; ValueError naming the argument."""
    if settings is None:
        return {}
    if isinstance(settings, Mapping):
        if section is not None:
            raise ValueError("section: give the keys in the settings mapping, not as section=")
        sections = dict(settings)
    else:
        sections = {key if section is None else section: settings}
    for name, cls in sections.items():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"settings: expected a dataclass type (or a mapping of keys to them), got {cls!r}")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"section: expected an identifier, got {name!r}")
        if name in ESTIMATOR_SECTIONS and ESTIMATOR_SECTIONS[name] is not cls:
            raise ValueError(f"section: {name!r} is already registered with {ESTIMATOR_SECTIONS[name].__name__}")
    return sections


def register_estimator(
    name: str | EstimatorName,
    *,
    needs_teacher_diag: Need = False,
    needs_alignment: bool = False,
    uses_mechanism2: bool = False,
    aux: Need = False,
    outcome_scaled: bool = False,
    description: str = "",
    loss_separable: bool = True,
    settings: type | Mapping[str, type] | None = None,
    section: str | None = None,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator registering an estimator under ``name`` with its declared needs (see :class:`EstimatorSpec`);
    a duplicate name raises ValueError.

    settings: the dataclass of the estimator's own config section, read and written as ``algorithm.<section>``
    (``section`` defaults to the estimator's name), or a mapping ``{key: dataclass}`` of several sections (a key
    another estimator registered shares its section, with the same dataclass). The dataclass's defaults apply when
    the config omits the section; the estimator reads it as ``config.section(key)``. Nothing else needs editing."""
    key = name.value if isinstance(name, EstimatorName) else name
    if not isinstance(key, str) or not key:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    sections = _settings_sections(settings, section, key)
    _check_need(needs_teacher_diag, "needs_teacher_diag")
    _check_need(aux, "aux")
    for flag, value in (
        ("needs_alignment", needs_alignment),
        ("uses_mechanism2", uses_mechanism2),
        ("outcome_scaled", outcome_scaled),
        ("loss_separable", loss_separable),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{flag}: expected true or false, got {value!r}")

    def deco(fn: EstimatorFn) -> EstimatorFn:
        if key in ESTIMATORS:
            raise ValueError(f"name: estimator {key!r} is already registered")
        ESTIMATOR_SECTIONS.update(sections)
        ESTIMATORS[key] = EstimatorSpec(
            name=key,
            fn=fn,
            teacher_diag=needs_teacher_diag,
            alignment=needs_alignment,
            mechanism2=uses_mechanism2,
            aux=aux,
            outcome_scaled=outcome_scaled,
            description=description or (fn.__doc__ or "").strip().split("\n")[0],
            loss_separable=loss_separable,
            sections=tuple(sections),
        )
        return fn

    return deco


def get_estimator(name: str | EstimatorName) -> EstimatorSpec:
    """The registered :class:`EstimatorSpec` of ``name`` (ValueError listing the registered names)."""
    key = name.value if isinstance(name, EstimatorName) else name
    if key not in ESTIMATORS:
        raise ValueError(f"name: unknown estimator {key!r}; allowed: {', '.join(map(repr, ESTIMATORS))}")
    return ESTIMATORS[key]


# --------------------------------------------------------------------------------------------------- shared pieces


def outcome_advantage(inp: EstimatorInputs, cfg: EstimatorConfig) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(A [M] per-turn GRPO advantage (§3.1), r [M] invalid residual (§3.10) or zeros, metrics): the outcome part of
    every outcome-based estimator, whose token advantage is mask · (A · w + r) with its own weights w (GRPO: w ≡ 1)."""
    A = grpo_advantage(inp.outcome, inp.task, inp.rollout, scope=cfg.grpo_scope, norm_by_std=cfg.norm_by_std)
    A = A.to(inp.old_logp.device)
    if cfg.use_invalid_penalty and inp.invalid is not None:
        r = invalid_action_residual(
            inp.outcome, inp.invalid, inp.task, penalty=cfg.invalid_penalty, norm_by_std=cfg.norm_by_std
        )
        r = r.to(A.device)
    else:
        r = torch.zeros_like(A)
    m = A.numel()  # means over this share's turns
    metrics = {
        "adv/outcome_advantage_mean": weighted_mean(float(A.double().mean()), m),
        "adv/outcome_advantage_abs_mean": weighted_mean(float(A.double().abs().mean()), m),
        "adv/invalid_residual_abs_mean": weighted_mean(float(r.double().abs().mean()), m),
    }
    return A, r, metrics


def _finish(token_adv: Tensor, inp: EstimatorInputs) -> Tensor:
    return (token_adv * inp.mask_f).float().detach()


def _teacher_gap(inp: EstimatorInputs) -> Tensor:
    inp.require("diag")
    return inp.diag - inp.old_logp  # type: ignore[operator]


def rlsd_lambda(step: int, *, lambda_init: float, decay_steps: int) -> float:
    """λ(step) = λ_init · max(0, 1 − step / decay_steps): linear decay to 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an integer >= 0, got {step!r}")
    if isinstance(decay_steps, bool) or not isinstance(decay_steps, int) or decay_steps < 1:
        raise ValueError(f"decay_steps: expected an integer >= 1, got {decay_steps!r}")
    check_real(lambda_init, "lambda_init", lo=0.0, hi=1.0)
    return float(lambda_init) * max(0.0, 1.0 - float(step) / float(decay_steps))


# --------------------------------------------------------------------------------------------------- estimators


@register_estimator(EstimatorName.GRPO, outcome_scaled=True)
def _grpo(inp: EstimatorInputs, cfg: EstimatorConfig) -> EstimatorOutput:
    """GRPO: Â = mask · (A + r), the outcome advantage plus the invalid residual; no teacher pass."""
    A, r, metrics = outcome_advantage(inp, cfg)
    return EstimatorOutput(_finish((A + r)[:, None].expand_as(inp.old_logp), inp), metrics=metrics)


@register_estimator(EstimatorName.SDAR, needs_teacher_diag=True, aux=True, outcome_scaled=True, settings=SdarConfig)
def _sdar(inp: EstimatorInputs, cfg: EstimatorConfig) -> EstimatorOutput:
    """SDAR: GRPO plus the §2.10 auxiliary (diagonal teacher, gate from the current policy)."""
    inp.require("diag")
    A, r, metrics = outcome_advantage(inp, cfg)
    sdar = cfg.section("sdar")
    aux = [AuxTerm("sdar", inp.diag, coef=sdar.coef, beta=sdar.beta)]  # type: ignore[arg-type]
    gap = _teacher_gap(inp)[inp.mask.bool()]
    metrics["sdar/teacher_gap_mean_rollout"] = weighted_mean(float(gap.double().mean()), gap.numel())
    return EstimatorOutput(_finish((A + r)[:, None].expand_as(inp.old_logp), inp), aux=aux, metrics=metrics)


@register_estimator(EstimatorName.OPSD, needs_teacher_diag=True, aux=True, settings=OpsdConfig)
def _opsd(inp: EstimatorInputs, cfg: EstimatorConfig) -> EstimatorOutput:
    """OPSD: gated distillation only (the SDAR-form term with the diagonal teacher); no outcome advantage."""
    inp.require("diag")
    opsd = cfg.section("opsd")
    aux = [AuxTerm("sdar", inp.diag, coef=opsd.coef, beta=opsd.beta)]  # type: ignore[arg-type]
    gap = _teacher_gap(inp)[inp.mask.bool()]
    metrics = {"opsd/teacher_gap_mean": weighted_mean(float(gap.double().mean()), gap.numel())}
    return EstimatorOutput(torch.zeros_like(inp.old_logp), aux=aux, metrics=metrics)


@register_estimator(
    EstimatorName.GRPO_OPSD, needs_teacher_diag=True, outcome_scaled=True, settings=OpsdConfig, section="opsd"
)
def _grpo_opsd(inp: EstimatorInputs, cfg: EstimatorConfig) -> EstimatorOutput:
    """GRPO + dense OPSD shaping, StepOPSD-style (sign-preserving, per-step credit budget).

    Per token m = clip(exp(sign(A)·δ), 1 − α_clip, 1 + α_clip) with δ = ℓ^diag − ℓ^old; each turn (agent
    step) normalises m to token-mean 1 (the step's credit budget), and the result is mixed globally:
    Â = mask · (A · ((1 − λ_mix) + λ_mix · m / mean_step(m)) + r). Multipliers are positive, so the sign
    of A is preserved, and each turn's token-sum of A-credit equals A · N_u.
    """
    A, r, metrics = outcome_advantage(inp, cfg)
    delta = _teacher_gap(inp)
    mf = inp.mask_f
    opsd = cfg.section("opsd")
    mult = torch.exp(torch.sign(A)[:, None] * delta).clamp(1.0 - opsd.clip, 1.0 + opsd.clip)
    step_mean = (mult * mf).sum(1) / mf.sum(1)
    shaped = mult / step_mean[:, None]
    lam = opsd.mix
    adv = A[:, None] * ((1.0 - lam) + lam * shaped) + r[:, None]
    n_tok = float(mf.sum())
    metrics["opsd/multiplier_mean"] = weighted_mean(float((shaped * mf).sum() / mf.sum()), n_tok)
    metrics["opsd/teacher_gap_mean"] = weighted_mean(float((delta * mf).sum() / mf.sum()), n_tok)
    return EstimatorOutput(_finish(adv, inp), metrics=metrics)


@register_estimator(EstimatorName.RLSD, needs_teacher_diag=True, outcome_scaled=True, settings=RlsdConfig)
def _rlsd(inp: EstimatorInputs, cfg: EstimatorConfig) -> EstimatorOutput:
    """RLSD: Â = mask · (A·((1−λ) + λ·clip(exp(sign(A)·Δ), lo, hi)) + r), Δ = ℓ^diag − ℓ^old, λ decayed to 0."""
    A, r, metrics = outcome_advantage(inp, cfg)
    delta = _teacher_gap(inp)
    rlsd = cfg.section("rlsd")
    lam = rlsd_lambda(inp.step, lambda_init=rlsd.lambda_init, decay_steps=rlsd.decay_steps)
    mult = torch.exp(torch.sign(A)[:, None] * delta).clamp(rlsd.clip_low, rlsd.clip_high)
    adv = A[:, None] * ((1.0 - lam) + lam * mult) + r[:, None]
    mf = inp.mask_f
    metrics["rlsd/lambda"] = same(lam)
    metrics["rlsd/multiplier_mean"] = weighted_mean(float((mult * mf).sum() / mf.sum()), float(mf.sum()))
    return EstimatorOutput(_finish(adv, inp), metrics=metrics)


def rectify_inputs(inp: EstimatorInputs, cfg: EstimatorConfig) -> tuple[Rectified, Tensor, dict[str, float]]:
    """Rectify (§2.7) with the config's α_max (0 under ablation A); returns (rect, δ̃ [M, L], m1 metrics)."""
    inp.require("diag", "H", "eligible")
    M, L = inp.old_logp.shape
    pairs = inp.pairs if inp.pairs is not None else torch.zeros(0, 2, dtype=torch.long)
    cross = inp.cross if inp.cross is not None else torch.zeros(0, L)
    rc = cfg.section("rectify")
    rect = rectify(
        inp.diag,  # type: ignore[arg-type]
        cross,
        pairs,
        inp.H,  # type: ignore[arg-type]
        gamma=rc.gamma,
        alpha_max=cfg.effective_alpha_max,
        temperature=rc.temperature,
        mode=rc.mode,
    )
    _, gap = rect.gaps(inp.old_logp)
    metrics = m1_diagnostics(rect, inp.old_logp, inp.mask, inp.H, inp.eligible, inp.turn, top_k=rc.top_k)  # type: ignore[arg-type]
    return rect, gap, metrics


def _rectification(inp: EstimatorInputs, cfg: EstimatorConfig) -> tuple[Rectified, Tensor, dict[str, float]]:
    """The inputs' precomputed rectification, else :func:`rectify_inputs` (metrics copied: callers add to them)."""
    rect, gap, metrics = inp.rectification if inp.rectification is not None else rectify_inputs(inp, cfg)
    return rect, gap, dict(metrics)


def _sdar_enabled(cfg: EstimatorConfig) -> bool:
    return bool(cfg.section("sdar").enabled)


@register_estimator(
    EstimatorName.ALIGNOPSD,
    needs_alignment=True,
    uses_mechanism2=True,
    aux=_sdar_enabled,
    outcome_scaled=True,
    settings={"rectify": RectifyConfig, "credit": CreditConfig, "sdar": SdarConfig},
)
def _alignopsd(inp: EstimatorInputs, cfg: EstimatorConfig) -> EstimatorOutput:
    """AlignOPSD: M1 rectification, then M2 credit (ablation A–E) on δ̃, plus the invalid residual;
    the SDAR auxiliary when ``sdar.enabled``. M2 adds no alignment loss term."""
    rect, gap, metrics = _rectification(inp, cfg)
    invalid = inp.invalid if cfg.use_invalid_penalty else None
    credit = allocate_credit(
        gap,
        inp.mask,
        inp.outcome,
        inp.task,
        inp.rollout,
        inp.turn,
        inp.H,
        inp.eligible,
        cfg.section("credit"),
        invalid=invalid,
        whole_batch=inp.whole_batch,
    )
    adv = credit.token_advantage.to(inp.old_logp.device).float()  # includes the §3.10 residual
    metrics.update(credit.metrics)
    aux: list[AuxTerm] = []
    sdar = cfg.section("sdar")
    if sdar.enabled:
        aux.append(AuxTerm("sdar", inp.diag, coef=sdar.coef, beta=sdar.beta))  # type: ignore[arg-type]
    return EstimatorOutput(_finish(adv, inp), aux=aux, metrics=metrics, rectified=rect, credit=credit)


@register_estimator(
    EstimatorName.ALIGNOPSD_M1,
    needs_alignment=True,
    aux=True,
    outcome_scaled=True,
    settings={"rectify": RectifyConfig, "alignment": AlignmentLossConfig},
)
def _alignopsd_m1(inp: EstimatorInputs, cfg: EstimatorConfig) -> EstimatorOutput:
    """M1-only (§2.9): verl-agent GRPO over all rows on R − c·invalid, plus coef · L_align with the
    rollout-frozen δ̃ gate."""
    rect, gap, metrics = _rectification(inp, cfg)
    score = inp.outcome.double()
    if cfg.use_invalid_penalty and inp.invalid is not None:
        score = score - cfg.invalid_penalty * inp.invalid.double()
    A = rowwise_grpo_advantage(score, inp.task, inp.copies, norm_by_std=cfg.norm_by_std).to(inp.old_logp.device)
    align = cfg.section("alignment")
    aux = [AuxTerm("alignment", rect.corrected, coef=align.coef, beta=align.beta, gate_gap_ML=gap)]
    metrics["beyond_timestamps/alignment_coef"] = same(align.coef)
    metrics["adv/outcome_advantage_abs_mean"] = weighted_mean(float(A.double().abs().mean()), A.numel())
    return EstimatorOutput(_finish(A[:, None].expand_as(inp.old_logp), inp), aux=aux, metrics=metrics, rectified=rect)

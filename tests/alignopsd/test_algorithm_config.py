"""Typed configs, presets of ALGORITHM.md §5, strict loader, overrides (§6 case 48)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from alignopsd.config import (
    PRESETS,
    AlgorithmConfig,
    AlignmentLossConfig,
    RectifyConfig,
    RlsdConfig,
    SdarConfig,
    apply_overrides,
    from_dict,
    get_preset,
    to_dict,
)

# γ, K, α_max, aggregation, T_c, GRPO scope, SDAR aux, action filter, kl coef, invalid penalty
TABLE = {
    "alfworld_3b": (0.65, 2, 0.8, "probability_mixture", 0.5, "turn", True, True, 0.01, 0.1),
    "alfworld_7b": (0.80, 3, 0.8, "probability_mixture", 0.5, "turn", False, False, 0.01, 0.1),
    "webshop_3b": (0.80, 3, 0.8, "probability_mixture", 0.2, "turn", False, True, 0.01, 0.1),
    "webshop_7b": (0.80, 2, 0.8, "probability_mixture", 0.5, "turn", False, False, 0.01, 0.1),
    "search_3b": (0.70, 3, 0.2, "log_mean", 1.0, "trajectory", False, False, 0.001, 0.01),
    "search_7b": (0.70, 3, 0.8, "probability_mixture", 0.5, "turn", False, False, 0.001, 0.01),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_paper_profiles(name):
    c = get_preset(name)
    got = (
        c.rectify.gamma,
        c.rectify.top_k,
        c.rectify.alpha_max,
        c.rectify.mode,
        c.credit.credit_temperature,
        c.grpo_scope,
        c.sdar.enabled,
        c.rectify.action_filter,
        c.kl_coef,
        c.invalid_penalty,
    )
    assert got == TABLE[name]
    assert c.estimator == "alignopsd" and c.ablation == "E" and c.mechanism2_enabled
    # common values
    assert (c.rectify.temperature, c.rectify.source_rollout_cap, c.rectify.action_threshold) == (0.1, 1, 0.8)
    cr = c.credit
    assert (cr.profile_temperature, cr.distance, cr.quantile, cr.tau_min, cr.tau_max) == (0.1, "jsd", 0.8, 0.01, 0.1)
    assert (cr.min_span_turns, cr.max_span_turns, cr.mixing, cr.density_upper_bound, cr.weighting) == (
        2,
        8,
        0.5,
        4.0,
        "legacy",
    )
    assert cr.gamma == c.rectify.gamma  # profile validity uses the M1 γ
    assert (c.clip_low, c.clip_high, c.entropy_coef, c.loss_agg_mode) == (0.2, 0.2, 0.001, "token-mean")
    assert (c.sdar.coef, c.sdar.beta) == (0.01, 5.0)
    # round trip through plain dicts
    assert from_dict(AlgorithmConfig, to_dict(c)) == c


@pytest.mark.parametrize(
    "name,kl,pen", [("m1_alfworld", 0.01, 0.1), ("m1_webshop", 0.01, 0.1), ("m1_search", 0.001, 0.01)]
)
def test_m1_only_profiles(name, kl, pen):
    c = PRESETS[name]()
    assert c.estimator == "alignopsd_m1" and not c.mechanism2_enabled
    assert (c.rectify.gamma, c.rectify.top_k, c.rectify.alpha_max, c.rectify.temperature) == (0.7, 3, 0.2, 0.1)
    assert c.rectify.mode == "probability_mixture"
    assert (c.alignment.beta, c.alignment.coef, c.kl_coef, c.invalid_penalty) == (5.0, 0.01, kl, pen)
    assert from_dict(AlgorithmConfig, to_dict(c)) == c


def test_case48_consistency():
    with pytest.raises(ValueError, match="mechanism2_enabled"):
        AlgorithmConfig(estimator="alignopsd_m1", mechanism2_enabled=True)
    with pytest.raises(ValueError, match="mechanism2_enabled"):
        AlgorithmConfig(estimator="alignopsd", mechanism2_enabled=False)
    assert AlgorithmConfig(estimator="alignopsd", mechanism2_enabled=True).mechanism2_enabled
    with pytest.raises(ValueError, match="loss_agg_mode"):
        AlgorithmConfig(loss_agg_mode="seq-mean-token-sum")
    with pytest.raises(ValueError, match="coef"):
        SdarConfig(coef=-0.01)
    SdarConfig(coef=0.0)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="beta"):
            SdarConfig(beta=bad)
        with pytest.raises(ValueError, match="beta"):
            AlignmentLossConfig(beta=bad)
    with pytest.raises(ValueError, match="algorithm.sdar.coef"):
        from_dict(AlgorithmConfig, {"sdar": {"coef": -1.0}}, "algorithm")


def test_field_validation():
    with pytest.raises(ValueError, match="source_rollout_cap"):
        RectifyConfig(source_rollout_cap=2)
    with pytest.raises(ValueError, match="gamma"):
        RectifyConfig(gamma=1.0)
    with pytest.raises(ValueError, match="top_k"):
        RectifyConfig(top_k=0)
    with pytest.raises(ValueError, match="alpha_max"):
        RectifyConfig(alpha_max=1.5)
    with pytest.raises(ValueError, match="temperature"):
        RectifyConfig(temperature=0.0)
    with pytest.raises(ValueError, match="clip_high"):
        RlsdConfig(clip_low=1.1, clip_high=1.0)
    with pytest.raises(ValueError, match="estimator"):
        AlgorithmConfig(estimator="ppo")
    with pytest.raises(ValueError, match="dual_clip"):
        AlgorithmConfig(dual_clip=1.0)
    # every field has a docstring in the source
    import inspect
    import sys

    for cls in (RectifyConfig, AlignmentLossConfig, SdarConfig, RlsdConfig, AlgorithmConfig):
        src = inspect.getsource(sys.modules[cls.__module__])
        for f in dataclasses.fields(cls):
            assert f"    {f.name}:" in src and '"""' in src.split(f"    {f.name}:", 1)[1].split("\n", 2)[1], f.name


def test_strict_loader_messages():
    with pytest.raises(ValueError, match=r"algorithm\.rectify\.gama: unknown key; allowed keys here: gamma, top_k"):
        from_dict(AlgorithmConfig, {"rectify": {"gama": 0.5}}, "algorithm")
    with pytest.raises(
        ValueError, match=r"rectify\.mode: unknown value 'foo'; allowed: 'probability_mixture', 'log_mean'"
    ):
        from_dict(AlgorithmConfig, {"rectify": {"mode": "foo"}})
    with pytest.raises(ValueError, match=r"ablation: unknown value 'F'"):
        from_dict(AlgorithmConfig, {"ablation": "F"})
    with pytest.raises(ValueError, match=r"rectify\.top_k: expected an integer"):
        from_dict(AlgorithmConfig, {"rectify": {"top_k": 2.5}})
    with pytest.raises(ValueError, match=r"rectify\.action_filter: expected true or false"):
        from_dict(AlgorithmConfig, {"rectify": {"action_filter": "yes"}})
    with pytest.raises(ValueError, match=r"rectify: expected a mapping"):
        from_dict(AlgorithmConfig, {"rectify": 3})
    with pytest.raises(ValueError, match=r"credit\.gamma: 0\.5 contradicts rectify\.gamma"):
        from_dict(AlgorithmConfig, {"credit": {"gamma": 0.5}})
    with pytest.raises(ValueError, match=r"credit\.mode: 'token' contradicts ablation"):
        from_dict(AlgorithmConfig, {"credit": {"mode": "token"}, "ablation": "E"})
    c = from_dict(AlgorithmConfig, {"credit": {"mode": "token"}, "ablation": "B", "rectify": {"gamma": 0}})
    assert c.credit.mode == "token" and isinstance(c.rectify.gamma, float) and c.credit.gamma == 0.0


def test_overrides():
    base = get_preset("alfworld_7b")
    c = apply_overrides(base, ["rectify.gamma=0.75", "rectify.action_filter=true", "ablation=C", "kl_coef=0"])
    assert c.rectify.gamma == 0.75 and c.credit.gamma == 0.75
    assert c.rectify.action_filter is True and c.credit.mode == "turn" and c.kl_coef == 0.0
    assert base.rectify.gamma == 0.8  # the input is not modified
    c2 = apply_overrides(base, ["estimator=grpo"])
    assert not c2.mechanism2_enabled
    with pytest.raises(ValueError, match=r"rectify\.gama: unknown key"):
        apply_overrides(base, ["rectify.gama=0.5"])
    with pytest.raises(ValueError, match="overrides"):
        apply_overrides(base, ["rectify.gamma"])
    with pytest.raises(ValueError, match=r"kl_coef: is a value, not a section"):
        apply_overrides(base, ["kl_coef.x=1"])
    with pytest.raises(ValueError, match="rectify.top_k"):
        apply_overrides(base, ["rectify.top_k=__import__('os')"])
    with pytest.raises(ValueError, match="name"):
        get_preset("alfworld_1b")


def test_yaml_string_floats_are_numbers_and_junk_is_named():
    """YAML 1.1 reads ``1e-3`` (no dot) as a string: float fields accept it; other strings name the key."""
    from alignopsd.config import AlgorithmConfig, from_dict

    cfg = from_dict(AlgorithmConfig, {"kl_coef": "1e-3"})
    assert cfg.kl_coef == 0.001 and isinstance(cfg.kl_coef, float)
    with pytest.raises(ValueError, match="kl_coef: expected a number"):
        from_dict(AlgorithmConfig, {"kl_coef": "small"})


def _real_fields(cls, prefix=""):
    """Dotted paths of every float-typed field of a config dataclass and its sections (fields, or registered with
    the estimators: the algorithm config's)."""
    import typing

    out = []
    sections = cls._registered_sections() if hasattr(cls, "_registered_sections") else {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in sections or f.name == "registered" and sections:
            continue
        tp = typing.get_type_hints(cls)[f.name]
        if tp is float:
            out.append(prefix + f.name)
        elif dataclasses.is_dataclass(tp):
            out += _real_fields(tp, f"{prefix}{f.name}.")
    for key, tp in sections.items():
        out += _real_fields(tp, f"{prefix}{key}.")
    return out


REAL_FIELDS = [
    k for k in _real_fields(AlgorithmConfig) if k not in AlgorithmConfig._DERIVED
]  # derived: set by their owner


def test_every_real_field_is_covered():
    assert {"rectify.gamma", "credit.mixing", "kl_coef", "opsd.clip", "rlsd.clip_high"} <= set(REAL_FIELDS)
    assert len(REAL_FIELDS) == 29


@pytest.mark.parametrize("raw", [".nan", ".inf", "-.inf", "nan", "'inf'", "'-inf'", "'NaN'"])
@pytest.mark.parametrize("key", REAL_FIELDS)
def test_non_finite_reals_are_rejected_at_load(key, raw):
    """Every real-valued setting rejects NaN and ±inf (YAML literals or strings) with the field's dotted name."""
    pattern = "^" + re.escape(key) + ": expected a finite number"
    with pytest.raises(ValueError, match=pattern):
        apply_overrides(AlgorithmConfig(), [f"{key}={raw}"])
    section, _, leaf = key.rpartition(".")
    data = {leaf: yaml.safe_load(raw)}  # a float or a string, as the YAML loader hands it over
    if section:
        data = {section: data}
    with pytest.raises(ValueError, match=pattern):
        from_dict(AlgorithmConfig, data)


def test_coerce_value_rules_shared_with_other_loaders():
    from alignopsd.config_values import coerce_value

    @dataclasses.dataclass
    class Section:
        lr: float = 1.0
        sizes: tuple[int, ...] = ()

    built = []

    def section(cls, data, path):
        built.append(path)
        return cls(
            **{
                k: coerce_value(f"{path}.{k}", float if k == "lr" else tuple[int, ...], v, section)
                for k, v in data.items()
            }
        )

    out = coerce_value("opt", Section | None, {"lr": "1e-3", "sizes": [1, 2]}, section)
    assert out == Section(lr=1e-3, sizes=(1, 2)) and built == ["opt"]
    assert coerce_value("x", float, 3, section) == 3.0 and isinstance(coerce_value("x", float, 3, section), float)
    for bad in (float("nan"), float("inf"), -float("inf"), "nan", "-inf", "Infinity"):
        with pytest.raises(ValueError, match=r"^opt\.lr: expected a finite number"):
            coerce_value("opt", Section, {"lr": bad}, section)
    with pytest.raises(ValueError, match=r"^x: expected an integer"):
        coerce_value("x", int, 1.5, section)

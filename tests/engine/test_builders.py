"""Builders registered by backend name: one row per backend the config accepts, and a backend without one refused
naming the key (engine/run/policy_builders.py, engine/run/components.py)."""

from __future__ import annotations

import typing

import pytest
import torch
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.config.sections import GenerationConfig, PolicyConfig
from alignopsd.engine.run import components, policy_builders


def _choices(section, field: str) -> set[str]:
    return set(typing.get_args(section.model_fields[field].annotation))


def test_every_backend_the_config_accepts_has_one_builder():
    assert set(policy_builders.POLICY_BUILDERS) == _choices(PolicyConfig, "backend") == {"hf", "megatron"}
    assert set(components.GENERATOR_BUILDERS) == _choices(GenerationConfig, "backend") == {"hf", "vllm", "choice"}
    with pytest.raises(ValueError, match="policy builder 'hf' is registered already"):
        policy_builders.register_policy_builder("hf")(lambda req: None)


def test_a_backend_without_a_builder_is_refused_naming_the_key(monkeypatch):
    cfg = load_config("configs/tiny.yaml", [])
    monkeypatch.delitem(policy_builders.POLICY_BUILDERS, "hf")
    with pytest.raises(ConfigError, match="policy.backend: no builder for 'hf'"):
        policy_builders.build_policy(cfg, torch.device("cpu"))
    monkeypatch.delitem(components.GENERATOR_BUILDERS, "hf")
    monkeypatch.setattr(components, "is_group_lead", lambda policy: True)  # a stand-in policy leads its group
    with pytest.raises(ConfigError, match="generation.backend: no builder for 'hf'"):
        components.build_generator(cfg, object(), None, torch.device("cpu"))

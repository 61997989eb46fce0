"""Pre-flight of the Megatron backend: a tensor-parallel layout that does not fit fails before any weight loads."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig


def _config(**kw):
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)  # fmt: skip
    base.update(kw)
    return LlamaConfig(**base)


@pytest.mark.parametrize(
    ("kw", "tp", "world", "culprit"),
    [
        ({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6}, 4, 4, "num_attention_heads = 6"),
        ({}, 4, 4, "num_key_value_heads = 2"),
        ({"num_key_value_heads": 4, "intermediate_size": 98}, 4, 4, "intermediate_size = 98"),
        ({"vocab_size": 513}, 2, 2, "vocab_size = 513"),
        ({}, 2, 3, "world size 3"),
    ],
)
def test_layout_errors_name_the_culprit(kw, tp, world, culprit):
    from alignopsd.engine.policy.megatron.convert import check_parallel_layout

    with pytest.raises(ValueError, match=culprit):
        check_parallel_layout(_config(**kw), tp, world)
    check_parallel_layout(_config(), 2, 4)  # a fitting layout passes


def test_build_policy_fails_before_loading_weights(monkeypatch):
    from alignopsd.engine import components
    from alignopsd.engine.config import load_config

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the pre-flight")

    monkeypatch.setattr(components, "load_causal_lm", no_load)
    cfg = load_config(str(components.Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"),
                      ["policy.backend=megatron", "policy.tensor_parallel_size=2"])  # fmt: skip
    with pytest.raises(ValueError, match="world size 3 is not a multiple"):
        components.build_policy(cfg, components.torch.device("cpu"), world_size=3)
    cfg = load_config(str(components.Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"),
                      ["policy.backend=megatron", "policy.tensor_parallel_size=4"])  # fmt: skip
    with pytest.raises(ValueError, match="does not divide num_attention_heads = 2"):
        components.build_policy(cfg, components.torch.device("cpu"), world_size=4)


def test_config_validates_megatron_fields():
    from alignopsd.engine.config import ConfigError, PolicyConfig

    with pytest.raises(ConfigError, match="policy.recompute"):
        PolicyConfig(backend="megatron", recompute="some")
    with pytest.raises(ConfigError, match="policy.distributed_optimizer"):
        PolicyConfig(backend="hf", distributed_optimizer=True)

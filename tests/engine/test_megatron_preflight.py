"""Pre-flight of the Megatron backend: a tensor-parallel layout that does not fit fails before any weight loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
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
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run import policy_builders as components

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the pre-flight")

    monkeypatch.setattr(components, "load_causal_lm", no_load)
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"),
                      ["policy.backend=megatron", "policy.tensor_parallel_size=2"])  # fmt: skip
    with pytest.raises(ValueError, match="world size 3 is not a multiple"):
        components.build_policy(cfg, torch.device("cpu"), world_size=3)
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"),
                      ["policy.backend=megatron", "policy.tensor_parallel_size=4"])  # fmt: skip
    with pytest.raises(ValueError, match="does not divide num_attention_heads = 2"):
        components.build_policy(cfg, torch.device("cpu"), world_size=4)


def test_config_validates_megatron_fields():
    from alignopsd.engine.config.schema import ConfigError, PolicyConfig

    with pytest.raises(ConfigError, match="policy.recompute"):
        PolicyConfig(backend="megatron", recompute="some")
    with pytest.raises(ConfigError, match="policy.distributed_optimizer"):
        PolicyConfig(backend="hf", distributed_optimizer=True)
    with pytest.raises(ConfigError, match="policy.layer_spec"):
        PolicyConfig(backend="megatron", layer_spec="flash")
    with pytest.raises(ConfigError, match="policy.layer_spec"):
        PolicyConfig(backend="hf", layer_spec="local")


def _tiny(*overrides):
    from alignopsd.engine.config.schema import load_config

    return load_config(str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"),
                       ["policy.backend=megatron", *overrides])  # fmt: skip


def test_transformer_engine_with_packed_prefixes_is_refused_at_load():
    """Transformer Engine's attention cannot score packed shared-prefix rows: the config says so when it loads,
    not the first teacher-forcing pass of a run."""
    from alignopsd.engine.config.schema import ConfigError

    with pytest.raises(ConfigError, match="policy.layer_spec: 'te'.*rescoring_mode='shared_prefix'"):
        _tiny("policy.layer_spec=te", "trainer.rescoring_mode=shared_prefix")
    _tiny("policy.layer_spec=te", "trainer.rescoring_mode=plain")  # plain rows are fine with it


@pytest.mark.parametrize(
    ("spec", "mode", "built"),
    [("auto", "shared_prefix", "local"), ("auto", "plain", "auto"), ("te", "plain", "te"), ("local", "plain", "local")],
)
def test_build_policy_passes_the_layer_spec(monkeypatch, spec, mode, built):
    """build_policy gives MegatronPolicy the configured spec, with ``auto`` resolved to ``local`` where packed
    shared prefixes need it (on a CUDA machine with Transformer Engine, ``auto`` alone would pick ``te``)."""
    from alignopsd.engine.policy.megatron import backend
    from alignopsd.engine.run import policy_builders as components

    seen = {}

    class Model:
        config, dtype = None, torch.float32

        def state_dict(self):
            return {}

    monkeypatch.setattr(components, "load_causal_lm", lambda *a, **k: Model())
    monkeypatch.setattr(backend, "tensor_parallel_rank", lambda *a, **k: 1)
    monkeypatch.setattr(backend, "MegatronPolicy", lambda *a, **kw: seen.update(kw) or object())
    cfg = _tiny(f"policy.layer_spec={spec}", f"trainer.rescoring_mode={mode}")
    components.build_policy(cfg, torch.device("cpu"), world_size=1)
    assert seen["layer_spec"] == built

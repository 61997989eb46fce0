"""The pydantic run-config schema: every bad value is one ConfigError naming its dotted key (never pydantic's own
error), sections built directly name their key too, and validate() checks a config again after edits."""

from __future__ import annotations

import pytest
from alignopsd.engine.config.schema import ConfigError, RunConfig, TrainerConfig, load_config

from alignopsd.config import AlgorithmConfig

SECTIONS = ("model", "policy", "generation", "encoder", "env", "trainer")


def _keys():
    for section in SECTIONS:
        for name in type(getattr(RunConfig(), section)).model_fields:
            yield f"{section}.{name}"


@pytest.mark.parametrize("key", list(_keys()))
def test_every_field_names_itself_when_its_value_has_the_wrong_type(key):
    """A nested list fits no field of a section: each refusal is a ConfigError that starts with the key."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=[[1]]"])
    assert str(err.value).startswith(key), str(err.value)
    assert "\n" not in str(err.value)


def test_numbers_written_as_text_and_integers_are_floats():
    cfg = load_config(
        None, ["trainer.optimizer.lr=2e-4", "trainer.optimizer.weight_decay=0", "generation.temperature=1"]
    )
    assert (cfg.trainer.optimizer.lr, cfg.trainer.optimizer.weight_decay, cfg.generation.temperature) == (
        2e-4,
        0.0,
        1.0,
    )
    assert all(
        isinstance(v, float)
        for v in (cfg.trainer.optimizer.lr, cfg.trainer.optimizer.weight_decay, cfg.generation.temperature)
    )
    with pytest.raises(ConfigError, match=r"^trainer\.optimizer\.lr: expected a number, got True"):
        load_config(None, ["trainer.optimizer.lr=true"])
    with pytest.raises(ConfigError, match=r"^generation\.do_sample: expected true or false, got 1"):
        load_config(None, ["generation.do_sample=1"])


def test_nested_options_name_the_non_finite_entry():
    with pytest.raises(ConfigError, match=r"^env\.options\.scales\[1\]: must be a finite number, got nan"):
        load_config(None, ["env.options={scales: [1.0, .nan]}"])
    assert load_config(None, ["env.options={scales: [1.0, 2.0]}"]).env.options == {"scales": [1.0, 2.0]}


def test_direct_construction_raises_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"^trainer\.optimizer\.lr: must be > 0, got 0"):
        TrainerConfig(lr=0)
    with pytest.raises(ConfigError, match=r"^trainer\.ppo\.micro_batch_size: 32 exceeds"):
        RunConfig(trainer={"ppo_mini_batch_size": 16, "ppo_micro_batch_size": 32})
    with pytest.raises(ConfigError, match=r"^algorithm: expected a mapping, got 3"):
        RunConfig(algorithm=3)
    with pytest.raises(ConfigError, match=r"^algorithm\.rectify\.gamma: must be < 1"):
        RunConfig(algorithm={"rectify": {"gamma": 1.0}})
    cfg = RunConfig(algorithm=AlgorithmConfig(estimator="grpo"), trainer=TrainerConfig(lr=0.5))
    assert cfg.algorithm.estimator == "grpo" and cfg.trainer.optimizer.lr == 0.5


def test_validate_checks_again_after_edits():
    cfg = load_config(None)
    cfg.trainer.optimizer.lr = -1.0
    with pytest.raises(ConfigError, match=r"^trainer\.optimizer\.lr: must be > 0"):
        cfg.validate()
    cfg.trainer.optimizer.lr = 0.1
    cfg.generation.backend = "vllm"
    cfg.generation.max_model_len = 100
    with pytest.raises(ConfigError, match=r"^generation\.max_model_len: 100 is smaller"):
        cfg.validate()
    cfg.generation.max_model_len = 1 << 14
    assert cfg.validate().generation.max_model_len == 1 << 14

"""The trainer section's sections (engine/config/trainer_section.py): the flat keys of earlier versions load at their
place now, from a file, a stored config and a ``--set`` override, and the resolved config is written in the new
layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from alignopsd.engine.config.dump import config_to_dict, dump_config
from alignopsd.engine.config.schema import ConfigError, RunConfig, load_config
from alignopsd.engine.config.trainer_section import (
    LEGACY_KEYS,
    OptimizerConfig,
    TrainerConfig,
    current_key,
    sectioned,
)
from alignopsd.engine.infra.mappings import flatten_config

ASSETS = Path(__file__).resolve().parents[1] / "assets"
STORED = ASSETS / "checkpoint_v1" / "step_000002" / "trainer_state.json"  # a config stored in the flat layout


def _write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_every_legacy_key_names_a_field_of_its_section():
    fields = flatten_config(config_to_dict(TrainerConfig()))
    for old, new in LEGACY_KEYS.items():
        if old != "tensorboard":  # the earlier switch, read into logging.loggers
            assert any(k == new or k.startswith(f"{new}.") for k in fields), (old, new)
    assert set(LEGACY_KEYS).isdisjoint(TrainerConfig.model_fields)  # no old key is a field any more


def test_a_stored_flat_config_loads_with_the_same_meaning(tmp_path):
    stored = json.loads(STORED.read_text())["run_config"]
    flat = stored["trainer"]
    cfg = RunConfig.from_mapping(stored)
    t = cfg.trainer
    assert (t.optimizer.lr, t.optimizer.betas, t.ppo.mini_batch_size, t.ppo.micro_batch_size) == (
        flat["lr"], tuple(flat["betas"]), flat["ppo_mini_batch_size"], flat["ppo_micro_batch_size"]
    )  # fmt: skip
    assert (t.checkpoint.save_freq, t.validation.freq, t.validation.after_train) == (
        flat["save_freq"], flat["test_freq"], flat["val_after_train"]
    )  # fmt: skip
    assert t.logging.loggers == ["jsonl"] and t.logging.report is False  # tensorboard: false, report: false
    assert t.total_steps == flat["total_steps"] and t.seed == flat["seed"]
    # the same file, read by the loader, and its dump in the new layout read back
    again = load_config(_write(tmp_path, stored))
    assert config_to_dict(again) == config_to_dict(cfg)
    dumped = yaml.safe_load(dump_config(cfg))
    assert "lr" not in dumped["trainer"] and dumped["trainer"]["optimizer"]["lr"] == flat["lr"]
    assert config_to_dict(load_config(_write(tmp_path, dumped))) == config_to_dict(cfg)


def test_overrides_by_either_name_win_over_the_file_by_either_name(tmp_path):
    old = _write(tmp_path, {"trainer": {"lr": 0.25, "ppo_mini_batch_size": 32}})
    assert load_config(old, ["trainer.optimizer.lr=0.5"]).trainer.optimizer.lr == 0.5
    assert load_config(old, ["trainer.ppo_mini_batch_size=64"]).trainer.ppo.mini_batch_size == 64
    new = _write(tmp_path, {"trainer": {"optimizer": {"lr": 0.25}}})
    assert load_config(new, ["trainer.lr=0.5"]).trainer.optimizer.lr == 0.5
    cfg = load_config(None, ["trainer.wandb.project=p", "trainer.test_freq=3", "trainer.val_start_step=2"])
    assert cfg.trainer.logging.wandb.project == "p"
    assert (cfg.trainer.validation.freq, cfg.trainer.validation.start_step) == (3, 2)
    assert current_key("trainer.lr") == "trainer.optimizer.lr" and current_key("env.lr") == "env.lr"


def test_a_key_given_both_ways_must_agree(tmp_path):
    assert sectioned({"lr": 0.5, "optimizer": {"lr": 0.5}}) == {"optimizer": {"lr": 0.5}}
    with pytest.raises(ConfigError, match=r"trainer\.lr: 0\.5 contradicts trainer\.optimizer\.lr = 0\.25"):
        load_config(_write(tmp_path, {"trainer": {"lr": 0.5, "optimizer": {"lr": 0.25}}}))
    with pytest.raises(ConfigError, match=r"^trainer\.save_freq: 2 contradicts trainer\.checkpoint\.save_freq"):
        RunConfig.from_mapping({"trainer": {"save_freq": 2, "checkpoint": {"save_freq": 3}}})
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.lr: must be > 0"):
        TrainerConfig(lr=0)  # an old keyword, checked at its place now
    built = TrainerConfig(lr=0.5, optimizer=OptimizerConfig(weight_decay=0.0))  # a section built in code, merged
    assert (built.optimizer.lr, built.optimizer.weight_decay) == (0.5, 0.0)

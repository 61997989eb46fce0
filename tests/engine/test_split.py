"""The data-parallel split (engine/parallel/split.py): one rule and one message for the trainer, the plan and the
warm start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.infra.errors import ConfigError
from alignopsd.engine.lab.step_plan import layout
from alignopsd.engine.parallel.split import check_split
from alignopsd.engine.policy.base import ParallelLayout
from alignopsd.engine.run.trainer import Trainer
from alignopsd.engine.step.supervised import rank_share

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_even_split_passes_and_an_uneven_one_names_the_key():
    check_split(8, 4, key="env.tasks_per_step", items="tasks per step")
    with pytest.raises(ConfigError) as exc:
        check_split(6, 4, key="env.tasks_per_step", items="tasks per step", groups_from="8 processes")
    assert str(exc.value) == (
        "env.tasks_per_step: 6 tasks per step do not split evenly over 4 data-parallel groups (8 processes); "
        "allowed: a multiple of 4"
    )
    with pytest.raises(ValueError, match="groups: expected >= 1"):
        check_split(6, 0, key="env.tasks_per_step", items="tasks per step")


def test_trainer_refuses_tasks_that_do_not_split(tmp_path):
    cfg = load_config(TINY, ["env.tasks_per_step=3", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^env\.tasks_per_step: 3 tasks per step do not split evenly over 2 "):
        Trainer(cfg, dist=SimpleNamespace(rank=0, world_size=2), lock_output=False)


def test_plan_and_warm_start_use_the_same_rule():
    cfg = load_config(TINY, ["env.tasks_per_step=3"])
    with pytest.raises(ConfigError, match=r"^env\.tasks_per_step: 3 tasks per step .* \(--world-size 2 / "):
        layout(cfg, 2)
    policy = SimpleNamespace(layout=ParallelLayout(dp_rank=1, dp_size=2))
    assert rank_share([1, 2, 3, 4], policy) == [2, 4]
    with pytest.raises(ConfigError, match=r"^--batch-size: 3 examples do not split evenly over 2 data-parallel"):
        rank_share([1, 2, 3], policy)

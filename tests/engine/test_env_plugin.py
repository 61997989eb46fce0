"""An environment defined only here: its registry row gives every environment-specific answer the engine needs
(truncation, task pool, evaluation columns, official-data check, skill bank), and the real pre-flight, training
and evaluation paths run it with no edit anywhere else.

``relay``: two turns; each observation is a long corridor description ending with the admissible actions
(``left``, ``right``); the episode is won when both actions are ``right``. Its prompts are longer than the run's
``max_prompt_length``, so its ``truncation="left"`` is what keeps the run alive (``"error"`` would stop it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from alignopsd.engine.config.errors import ConfigError
from alignopsd.engine.envs.base import StepResult, TaskSpec, percent
from alignopsd.engine.envs.official import OfficialDataQuery, official_data_error
from alignopsd.engine.envs.prompts import PromptBuilder
from alignopsd.engine.envs.registry import EnvEntry, env_names, get_entry, register_env

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
ACTIONS = ("left", "right")
CORRIDOR = "The corridor stretches on, lined with doors and lamps. " * 12
DATA_VAR = "RELAY_OFFICIAL_DATA"
POOLS: list[tuple[str, int | None]] = []  # (split, pool_size) of every task-source call
QUERIES: list[OfficialDataQuery] = []  # what the pre-flight asked the official-data check about


def load_tasks(split: str = "train", n: int | None = None, seed: int = 0, pool_size: int | None = None, **_: Any):
    POOLS.append((split, pool_size))
    n = 4 if not n or n <= 0 else int(n)
    return [TaskSpec(key=f"relay-{split}-{i}", env="relay", category=("near", "far")[i % 2]) for i in range(n)]


class RelayEnv:
    name = "relay"
    max_steps = 2

    def __init__(self, **_: Any) -> None:
        self.t, self.first = 0, ""

    def _info(self, won: bool = False) -> dict[str, Any]:
        return {"won": won, "admissible_actions": list(ACTIONS), "task": "go right twice."}

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        self.t, self.first = 0, ""
        return CORRIDOR + "You stand at a fork.", self._info()

    def step(self, action: str) -> StepResult:
        self.t += 1
        if self.t == 1:
            self.first = action
            return StepResult(CORRIDOR + f"You went {action or 'nowhere'}.", 0.0, False, self._info())
        won = self.first == "right" and action == "right"
        return StepResult("The end.", 10.0 if won else 0.0, True, self._info(won))


def relay_prompt(history_length: int = 1) -> PromptBuilder:
    return PromptBuilder(
        "Task: {task_description}\nObservation: {current_observation}\nActions: [{admissible_actions}].\n",
        "Task: {task_description}\n{action_history}\n"
        "Observation: {current_observation}\nActions: [{admissible_actions}].\n",
        history_length,
        history_item="Step {index}: {action}",
        action_sep=", ",
    )


def table_columns(metrics: dict[str, float]) -> dict[str, float | None]:
    return {"Near": percent(metrics, "episode/success/near"), "Relay": percent(metrics, "episode/success_rate")}


def check_official_data(query: OfficialDataQuery, environ) -> None:
    QUERIES.append(query)
    if not environ.get(DATA_VAR):
        raise official_data_error(f"${DATA_VAR} is unset", f"export {DATA_VAR} pointing at the relay data")


ENTRY = EnvEntry(
    "relay",
    f"{__name__}:RelayEnv",
    f"{__name__}:load_tasks",
    f"{__name__}:relay_prompt",
    lowercase_actions=True,
    history_length=1,
    truncation="left",
    task_pool=True,
    eval_columns=f"{__name__}:table_columns",
    official_data=f"{__name__}:check_official_data",
)

OVERRIDES = [
    "env.name=relay",
    "env.max_turns=2",
    "env.history_length=1",
    "env.group_n=2",
    "env.tasks_per_step=2",
    "env.num_games=4",
    "env.val_tasks=2",
    "env.max_prompt_length=96",
    "algorithm.kl_coef=0.0",
    "generation.backend=choice",
    "trainer.total_steps=1",
    "trainer.ppo.mini_batch_size=16",
    "trainer.ppo.micro_batch_size=8",
]


@pytest.fixture(scope="module")
def relay():
    if "relay" not in env_names():
        register_env(ENTRY)
    assert get_entry("relay") is ENTRY
    return ENTRY


def _config(tmp_path, *extra: str):
    from alignopsd.engine.config.schema import load_config

    bank = tmp_path / "skills" / "relay"
    bank.mkdir(parents=True, exist_ok=True)
    (bank / "general.md").write_text("Keep to the right.")
    mapping = {"skill_files": {"general_skills": "general.md"}, "task_to_skill": {}, "task_keywords": {}}
    (bank / "skill_mapping.json").write_text(json.dumps(mapping))
    out = [*OVERRIDES, f"output_dir={tmp_path / 'run'}", f"env.skills_dir={tmp_path / 'skills'}", *extra]
    return load_config(TINY, out)


def test_registry_refuses_a_bad_row():
    with pytest.raises(ValueError, match="entry.truncation"):
        register_env(EnvEntry("bad", "m:f", "m:t", "m:p", truncation="right"))
    with pytest.raises(ValueError, match="entry.action_rule"):
        register_env(EnvEntry("bad", "m:f", "m:t", "m:p", action_rule="alfworld"))
    assert "bad" not in env_names()


def test_preflight_runs_the_rows_official_data_check(relay, tmp_path):
    from alignopsd.engine.config.preflight import preflight

    on = ("env.require_official_data=true",)
    cfg = _config(tmp_path, *on)
    with pytest.raises(ConfigError, match=f"env.require_official_data: \\${DATA_VAR} is unset"):
        preflight(cfg, env={})
    preflight(cfg, env={DATA_VAR: str(tmp_path)})
    QUERIES.clear()
    preflight(_config(tmp_path), env={})  # not required: the check is not run
    assert QUERIES == []
    # the check is handed the run's values, not its config: the data folder, the splits it reads (once each)
    preflight(_config(tmp_path, *on, f"env.data_dir={tmp_path}", "env.val_split=train"), env={DATA_VAR: "x"})
    assert QUERIES == [OfficialDataQuery(str(tmp_path), ("train",), {})]


@pytest.mark.slow
def test_trains_and_evaluates_through_its_row(relay, tmp_path):
    from alignopsd.engine.commands.evaluate import evaluate
    from alignopsd.engine.observe.metrics import read_metrics
    from alignopsd.engine.run.trainer import Trainer

    torch.set_num_threads(1)
    cfg = _config(tmp_path)
    POOLS.clear()
    Trainer(cfg).fit()
    assert POOLS == [("train", 4), ("test", 2)]  # task_pool: no data_dir, so the source gets its pool sizes
    (rec,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    cut = {k: v for k, v in rec.items() if k.endswith("/prompt_truncated")}
    assert cut and all(v > 0 for v in cut.values()), cut  # truncation "left": the long prompts were cut, kept
    res = evaluate(_config(tmp_path, f"output_dir={tmp_path / 'eval'}"))
    assert res["env"] == "relay" and res["episodes"] == 2
    assert list(res["table"]) == ["Near", "Relay"]
    assert res["table"]["Relay"] == pytest.approx(100.0 * res["metrics"]["episode/success_rate"])

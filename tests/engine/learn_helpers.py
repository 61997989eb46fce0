"""Helpers for the learning / resume / golden tests: a learnable two-turn task and a candidate-choice generator.

``GuessEnv``: two turns; each turn the admissible actions are ``left`` and ``right``; the episode is won
(reward 10) when the second action repeats the first one and both are ``right``. A uniformly random policy
wins 1 in 4 episodes; the turn-level pattern is learnable by a tiny model in a few updates.

The runs generate with the package's candidate-choice backend (``generation.backend=choice``,
engine/generation/choice.py): random-weight models cannot yet write the tag format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.envs.base import StepResult, TaskSpec
from alignopsd.engine.envs.prompts import PromptBuilder

ACTIONS = ("left", "right")


def load_tasks(split: str = "train", n: int | None = None, seed: int = 0, **_: Any) -> list[TaskSpec]:
    n = 8 if not n or n <= 0 else int(n)
    return [TaskSpec(key=f"guess-{split}-{i}", env="guess", category=("even" if i % 2 == 0 else "odd"))
            for i in range(n)]  # fmt: skip


class GuessEnv:
    name = "guess"
    max_steps = 2

    def __init__(self, **_: Any) -> None:
        self.t = 0
        self.first = ""

    def _info(self, won=False):
        return {"won": won, "admissible_actions": list(ACTIONS), "task": "go right twice."}

    def reset(self, task: TaskSpec, seed: int):
        self.t, self.first = 0, ""
        return "You stand at a fork.", self._info()

    def step(self, action: str) -> StepResult:
        self.t += 1
        if self.t == 1:
            self.first = action
            return StepResult(f"You went {action or 'nowhere'}.", 0.0, False, self._info())
        won = self.first == "right" and action == "right"
        return StepResult("The end.", 10.0 if won else 0.0, True, self._info(won))


def guess_prompt(history_length: int = 1) -> PromptBuilder:
    return PromptBuilder(
        "Task: {task_description}\nObservation: {current_observation}\nActions: [{admissible_actions}].\n",
        "Task: {task_description}\n{action_history}\n"
        "Observation: {current_observation}\nActions: [{admissible_actions}].\n",
        history_length,
        history_item="Step {index}: {action}",
        action_sep=", ",
    )


def register_guess_env() -> None:
    from alignopsd.engine.envs import registry

    if "guess" not in registry.env_names():
        registry.register_env(
            registry.EnvEntry(
                "guess",
                f"{__name__}:GuessEnv",
                f"{__name__}:load_tasks",
                f"{__name__}:guess_prompt",
                lowercase_actions=True,
                history_length=1,
            )
        )


def build_trainer(config: str, overrides: list[str]):
    """A Trainer generating with the candidate-choice backend on the trainer's own model (guess env registered)."""
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.trainer import Trainer

    register_guess_env()
    return Trainer(load_config(config, ["generation.backend=choice", *overrides]))


def main(argv: list[str]) -> None:
    """``python -c 'import learn_helpers as h; h.main(sys.argv[1:])' CONFIG [--resume auto] [--set k=v ...]``."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--resume", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    build_trainer(args.config, args.overrides).fit(resume=args.resume)


# ---------------------------------------------------------------------------------------------------------------------
# the per-estimator step fixture shared by the golden traces and the estimator/device tests

GUESS_OVERRIDES = [
    "env.name=guess",
    "env.max_turns=2",
    "env.history_length=1",
    "env.group_n=4",
    "env.tasks_per_step=4",
    "env.num_games=8",
    "algorithm.kl_coef=0.0",
    "trainer.optimizer.lr=1e-4",
    "trainer.ppo.mini_batch_size=16",
    "trainer.ppo.micro_batch_size=8",
]

# every estimator of the registry and every AlignOPSD ablation: (case name, overrides)
ESTIMATOR_CASES: list[tuple[str, list[str]]] = [
    ("grpo", ["algorithm.estimator=grpo"]),
    ("opsd", ["algorithm.estimator=opsd"]),
    ("grpo_opsd", ["algorithm.estimator=grpo_opsd"]),
    ("sdar", ["algorithm.estimator=sdar"]),
    ("rlsd", ["algorithm.estimator=rlsd"]),
    ("alignopsd_m1", ["algorithm.estimator=alignopsd_m1"]),
    *[(f"alignopsd_{ab}", ["algorithm.estimator=alignopsd", f"algorithm.ablation={ab}"]) for ab in "ABCDE"],
    ("alignopsd_E_kl_sdar", ["algorithm.estimator=alignopsd", "algorithm.kl_coef=0.01", "algorithm.sdar.enabled=true"]),
]


TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def no_region_errors(metrics: dict) -> bool:
    """A step's metrics report no failed region diagnostic (strict mode raises instead; this catches a count)."""
    return metrics.get("regions/errors", 0.0) == 0.0


def run_tiny(out_dir, overrides: list[str], steps: int, config: str | None = None):
    """Train tiny.yaml (guess env, choice generator) for ``steps`` steps; (trainer, metric records)."""
    from pathlib import Path

    from alignopsd.engine.observe.metrics import read_metrics

    torch.set_num_threads(1)
    cfg = config or str(TINY_CONFIG)
    ov = [*GUESS_OVERRIDES, *overrides, f"trainer.total_steps={steps}", f"output_dir={out_dir}"]
    tr = build_trainer(cfg, ov)
    tr.fit()
    recs = read_metrics(Path(out_dir) / "metrics.jsonl")
    assert all(no_region_errors(r) for r in recs)
    return tr, recs


GOLDEN_KEYS = (
    "actor/loss",
    "actor/pg_loss",
    "episode/reward_mean",
    "actor/grad_norm",
    "adv/token_advantage_abs_mean",
)


def trace_of(recs) -> list[dict]:
    """The golden-trace fields of each step's metric record (missing keys are left out)."""
    return [{"step": r["step"], **{k: r[k] for k in GOLDEN_KEYS if k in r}} for r in recs]

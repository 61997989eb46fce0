"""The plan of ``alignopsd compare``: which (estimator, seed) runs, on which config overrides, evaluated when.

See engine/commands/compare.py for what is held equal across estimators.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from alignopsd.engine.config.schema import ConfigError, RunConfig, load_config
from alignopsd.engine.config.trainer_section import current_key

# config keys compare sets for every run (a --set of one of them is refused: it would break the comparison)
OWNED_KEYS = (
    "algorithm.estimator",
    "trainer.seed",
    "trainer.total_steps",
    "trainer.validation.freq",
    "output_dir",
    "trainer.validation.start_step",
    "trainer.validation.before_train",
    "trainer.validation.after_train",
)
SUCCESS = "episode/success_rate"
VAL_TASKS_FILE = "val_tasks.json"


@dataclass(frozen=True)
class RunSpec:
    """One (estimator, seed) run of a comparison."""

    estimator: str
    seed: int
    out_dir: Path
    config: str
    overrides: tuple[str, ...]  # the user's overrides, then the ones compare sets (OWNED_KEYS)

    @property
    def label(self) -> str:
        return f"{self.estimator}-seed{self.seed}"

    def load(self) -> RunConfig:
        return load_config(self.config, list(self.overrides))


@dataclass(frozen=True)
class Plan:
    """A checked comparison: its runs, evaluation schedule, output folder and held-out seed."""

    config: str
    overrides: tuple[str, ...]
    estimators: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    eval_every: int
    out: Path
    val_seed: int
    runs: tuple[RunSpec, ...]
    base: RunConfig  # the config with the user's overrides only (name, model, environment)

    @property
    def schedule(self) -> list[int]:
        return eval_schedule(self.steps, self.eval_every)


def eval_schedule(steps: int, eval_every: int) -> list[int]:
    """The evaluation steps of a run of ``steps`` steps: 0, every ``eval_every`` (0: none between), ``steps``."""
    between = range(eval_every, steps, eval_every) if eval_every > 0 else range(0)
    return sorted({0, *between, steps})


def _check_options(overrides: tuple[str, ...], estimators: Sequence[str], seeds: int, steps: int, eval_every: int):
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if current_key(key) in OWNED_KEYS:  # by its name now or an earlier version's (trainer.test_freq)
            raise ConfigError(
                f"--set {key}: compare sets it for every run (use --estimators, --seeds, --steps, --eval-every, --out)"
            )
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"--seeds: the number of seeds must be an int >= 1, got {seeds!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps: expected an int >= 1, got {steps!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 0:
        raise ConfigError(f"--eval-every: expected an int >= 0 (0: only before and after training), got {eval_every!r}")
    names = [e.strip() for e in estimators]
    if not names or not all(names) or len(set(names)) != len(names):
        raise ConfigError(f"--estimators: expected distinct, non-empty estimator names, got {list(estimators)!r}")


def plan_comparison(
    config: str | os.PathLike,
    *,
    estimators: Sequence[str],
    seeds: int,
    steps: int,
    eval_every: int | None = None,
    out: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    val_seed: int | None = None,
    first_seed: int | None = None,
) -> Plan:
    """Check everything a comparison needs before anything heavy loads (ConfigError naming the culprit):
    the options, the config of every run and the pre-flight checks of each (engine/config/preflight.py)."""
    from alignopsd.engine.config.preflight import preflight

    overrides = tuple(overrides)
    estimators = estimators.split(",") if isinstance(estimators, str) else estimators
    eval_every = max(1, steps // 10) if eval_every is None and isinstance(steps, int) else eval_every
    _check_options(overrides, estimators, seeds, steps, eval_every)
    names = tuple(e.strip() for e in estimators)
    base = load_config(config, list(overrides))
    first = base.trainer.seed if first_seed is None else int(first_seed)
    seed_list = tuple(range(first, first + seeds))
    out_dir = Path(out) if out is not None else Path("runs") / f"compare-{base.name}"
    runs = []
    for est in names:
        for seed in seed_list:
            run_dir = out_dir / f"{est}-seed{seed}"
            own = (
                f"algorithm.estimator={est}",
                f"trainer.seed={seed}",
                f"trainer.total_steps={steps}",
                f"trainer.validation.freq={eval_every if eval_every > 0 else -1}",
                "trainer.validation.start_step=0",
                "trainer.validation.before_train=true",
                "trainer.validation.after_train=true",
                f"output_dir={run_dir}",
            )
            spec = RunSpec(est, seed, run_dir, str(config), overrides + own)
            preflight(spec.load())
            runs.append(spec)
    return Plan(
        config=str(config),
        overrides=overrides,
        estimators=names,
        seeds=seed_list,
        steps=steps,
        eval_every=eval_every,
        out=out_dir,
        val_seed=base.trainer.seed if val_seed is None else int(val_seed),
        runs=tuple(runs),
        base=base,
    )


def held_out_tasks(plan: Plan) -> list:
    """The held-out games of every run: the validation split sampled once with the plan's ``val_seed`` (the
    rule of a training run, ``components.build_env``, with the environment built in-process and not played)."""
    from alignopsd.engine.run.components import build_env

    cfg = load_config(plan.config, [*plan.overrides, f"trainer.seed={plan.val_seed}", "env.workers=0"])
    env, _, val_tasks = build_env(cfg)
    env.close()
    return list(val_tasks)


# ---------------------------------------------------------------------------------------------------------------------
# one run

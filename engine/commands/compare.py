"""Estimators side by side: ``alignopsd compare --config FILE --estimators grpo,alignopsd --seeds 3 --steps N``.

Trains every (estimator, seed) pair of a config for ``N`` steps and evaluates the held-out success of each run on
one schedule, then writes, under ``--out`` (default ``runs/compare-<config name>``):

* ``<estimator>-seed<seed>/``: the run directory of each pair (the trainer's own files: ``metrics.jsonl``,
  ``config.yaml``, checkpoints, report), plus ``val_tasks.json`` (the keys of the held-out games it played);
* ``compare.json``: the plan, every run's held-out success at every evaluation step, and the summary;
* ``compare.md``: held-out success (rows: evaluation steps; columns: estimators; cells ``mean ± std (n)`` over
  seeds, in percent), the ``alignopsd eval`` table of the last step, the paired per-seed difference to the first
  estimator, the wall seconds per step;
* ``compare.png``: held-out success over steps, a mean line and a ±1 std band per estimator (thin lines: seeds).

What is held equal across estimators, so that the estimator is the only difference:

* starting weights: every run loads ``model.name`` as configured;
* training tasks and sampling seeds: a run of seed ``s`` sets ``trainer.seed=s``; the tasks of each step and all
  sampling derive from it (engine/step/episodes.py), identically for every estimator;
* held-out games: the environment's validation split is sampled with the run's seed (``components.build_env``),
  so compare builds it once from ``--val-seed`` (default: the config's ``trainer.seed``) and gives that same list
  to every run (``parts.val_tasks``); each run records the keys it played in ``val_tasks.json``;
* evaluation schedule: before the first step (step 0), every ``--eval-every`` steps and after the last step
  (``trainer.val_before_train``, ``trainer.test_freq``, ``trainer.val_after_train``, ``trainer.val_start_step=0``).
  Validation samples with seeds of the run's seed and step, so for one seed every estimator's step-0 evaluation
  is the same pass on the same weights.

Runs are sequential in this process (each builds its own Trainer, which re-seeds every generator), so one place
decides the held-out games, and under ``torchrun`` every rank runs the same sequence (rank 0 writes). Resumable: a
run whose ``metrics.jsonl`` holds its last step and last evaluation is read, not redone, once its stored config and
held-out games are checked to be the ones asked for; an unfinished run resumes from its newest verified
checkpoint (``--set trainer.save_freq=K`` makes long runs resumable mid-way), or starts again. So each run can
also have a fresh process of its own (``--estimators grpo --seeds 1 --first-seed 2``, same ``--out``), and a last
call with every estimator and seed reads them all and writes the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignopsd.engine.config.schema import ConfigError, RunConfig, load_config
from alignopsd.engine.run.manifest import atomic_write_bytes
from alignopsd.engine.run.metrics import read_metrics
from alignopsd.engine.run.resume import config_changes, stored_config

# config keys compare sets for every run (a --set of one of them is refused: it would break the comparison)
OWNED_KEYS = ("algorithm.estimator", "trainer.seed", "trainer.total_steps", "trainer.test_freq", "output_dir",
              "trainer.val_start_step", "trainer.val_before_train", "trainer.val_after_train")  # fmt: skip
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
        if key in OWNED_KEYS:
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
                f"trainer.test_freq={eval_every if eval_every > 0 else -1}",
                "trainer.val_start_step=0",
                "trainer.val_before_train=true",
                "trainer.val_after_train=true",
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


class PrefixedStream:
    """A text stream writing each complete line to ``stream`` with ``prefix`` in front (one run's progress)."""

    def __init__(self, stream, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        while "\n" in self._pending:
            line, self._pending = self._pending.split("\n", 1)
            self.stream.write(f"{self.prefix}{line}\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def finished_evaluations(run_dir: Path, steps: int) -> dict[int, dict] | None:
    """The validation records (by step; the last of a step) of a run that trained ``steps`` steps and was
    evaluated after the last one; None when the run is missing or unfinished."""
    recs = read_metrics(Path(run_dir) / "metrics.jsonl", kind=None)
    trained = any(r.get("kind", "train") == "train" and int(r.get("step", -1)) == steps for r in recs)
    val = {int(r["step"]): r for r in recs if r.get("kind") == "val"}
    if not trained or steps not in val:
        return None
    return val


def check_reusable(spec: RunSpec, task_keys: list[str]) -> None:
    """A finished run is reused only if it was trained with this run's config and evaluated on these games."""
    try:
        saved = stored_config(load_config(spec.out_dir / "config.yaml"))
    except ConfigError as exc:
        raise ConfigError(f"{spec.out_dir}: cannot read the finished run's config.yaml ({exc})") from None
    blocking, _ = config_changes(saved, stored_config(spec.load()), step=0)
    if blocking:
        listed = "\n  ".join(blocking)
        raise ConfigError(
            f"{spec.out_dir}: this finished run was trained with another config:\n  {listed}\n"
            "use another --out, or remove that run directory to train it again"
        )
    path = spec.out_dir / VAL_TASKS_FILE
    played = json.loads(path.read_text()) if path.exists() else None
    if played != task_keys:
        raise ConfigError(
            f"{path}: this finished run was evaluated on other held-out games than the {len(task_keys)} of "
            "--val-seed; use another --out, or remove that run directory to train it again"
        )


def default_trainer(config: str, overrides: list[str]):
    """The real trainer of one run (the factory ``run`` uses unless given another)."""
    from alignopsd.engine.run.trainer import Trainer

    return Trainer(load_config(config, overrides))


def train_one(spec: RunSpec, steps: int, val_tasks: list, factory: Callable, stream) -> dict[int, dict]:
    """Train one run (resuming from its newest verified checkpoint if it has one) on the pinned held-out games;
    its validation records by step."""
    import torch

    keys = [t.key for t in val_tasks]
    if int(os.environ.get("RANK", "0")) == 0:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(spec.out_dir / VAL_TASKS_FILE, json.dumps(keys).encode())
    trainer = factory(spec.config, list(spec.overrides))
    try:
        trainer.parts.val_tasks = list(val_tasks)
        trainer.stream = PrefixedStream(stream, f"[{spec.label}] ")
        trainer.fit(resume="auto")
        trainer.dist.barrier()  # rank 0 has written the run's last records before any rank reads them
    finally:
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    val = finished_evaluations(spec.out_dir, steps)
    if val is None:
        raise RuntimeError(f"{spec.out_dir}: the run ended without a training record and an evaluation at step {steps}")
    return val


def train_runs(plan: Plan, *, trainer_factory: Callable | None, stream) -> tuple[list[str], dict[tuple, dict]]:
    """Every run of the plan, in order: read when finished earlier, else trained. Returns the keys of the
    held-out games and the validation records (by step) of each (estimator, seed)."""
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def say(line: str) -> None:
        if rank0:
            print(f"[compare] {line}", file=stream, flush=True)

    val_tasks = held_out_tasks(plan)
    keys = [t.key for t in val_tasks]
    say(
        f"{len(plan.runs)} runs, {plan.steps} steps each, held-out games ({len(keys)}, val seed {plan.val_seed}): "
        f"{', '.join(keys)}"
    )
    factory = trainer_factory or default_trainer
    evals: dict[tuple[str, int], dict[int, dict]] = {}
    for i, spec in enumerate(plan.runs, 1):
        head = f"run {i}/{len(plan.runs)} {spec.label}"
        val = finished_evaluations(spec.out_dir, plan.steps)
        if val is not None:
            check_reusable(spec, keys)
            say(f"{head}: finished earlier, read {spec.out_dir / 'metrics.jsonl'}")
        else:
            say(f"{head}: start ({spec.out_dir})")
            t0 = time.perf_counter()
            val = train_one(spec, plan.steps, val_tasks, factory, stream)
            say(f"{head}: done in {time.perf_counter() - t0:.1f} s")
        say(f"{head}: held-out success " + ", ".join(f"step {s}: {_fmt(_value(val[s]))}" for s in sorted(val)))
        evals[(spec.estimator, spec.seed)] = val
    return keys, evals


# ---------------------------------------------------------------------------------------------------------------------
# summary and outputs


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (None below two values) and count of ``values``."""
    vals = [float(v) for v in values]
    return {
        "mean": statistics.fmean(vals) if vals else None,
        "std": statistics.stdev(vals) if len(vals) > 1 else None,
        "n": len(vals),
        "values": vals,
    }


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _value(rec: dict | None, key: str = SUCCESS) -> float | None:
    v = None if rec is None else rec.get(key)
    return None if v is None or not math.isfinite(v) else float(v)


def summarize(plan: Plan, evals: dict[tuple[str, int], dict[int, dict]]) -> dict[str, Any]:
    """Held-out success per estimator and evaluation step (fractions), the environment's held-out table at the
    last step (percent), and the paired per-seed difference of the last step's success to the first estimator."""
    from alignopsd.engine.commands.evaluate import table_values

    success: dict[str, dict[str, Any]] = {}
    final_table: dict[str, dict[str, Any]] = {}
    for est in plan.estimators:
        runs = [evals[(est, s)] for s in plan.seeds]
        success[est] = {
            str(step): spread([v for r in runs if (v := _value(r.get(step))) is not None]) for step in plan.schedule
        }
        tables = [table_values(plan.base.env.name, r[plan.steps]) for r in runs]
        columns = list(dict.fromkeys(c for t in tables for c in t))
        final_table[est] = {c: spread([t[c] for t in tables if t.get(c) is not None]) for c in columns}
    first = plan.estimators[0]
    paired = {}
    for est in plan.estimators[1:]:
        diffs = []
        for s in plan.seeds:
            a, b = _value(evals[(first, s)][plan.steps]), _value(evals[(est, s)][plan.steps])
            if a is not None and b is not None:
                diffs.append(b - a)
        paired[est] = spread(diffs)
    return {"success": success, "final_table": final_table, "paired_vs_first": paired}


def step_seconds(plan: Plan) -> dict[str, dict[str, Any]]:
    """Mean wall seconds per training step of each estimator (over its runs' steps, from their own records)."""
    means = {}
    for spec in plan.runs:
        ys = [_value(r, "time/step_wall") for r in read_metrics(spec.out_dir / "metrics.jsonl", "train")]
        means[spec] = statistics.fmean(y for y in ys if y is not None) if any(y is not None for y in ys) else None
    return {e: spread([m for r, m in means.items() if r.estimator == e and m is not None]) for e in plan.estimators}


def _cell(d: dict[str, Any], scale: float = 100.0) -> str:
    if not d["n"]:
        return "–"
    std = "" if d["std"] is None else f" ± {scale * d['std']:.1f}"
    return f"{scale * d['mean']:.1f}{std} (n={d['n']})"


def markdown(plan: Plan, summary: dict[str, Any], n_games: int, seconds: dict[str, dict[str, Any]]) -> str:
    """compare.md: the held-out success table, the last step's held-out table, the paired differences."""
    cfg = plan.base
    ests = plan.estimators
    sets = f" with `{' '.join('--set ' + o for o in plan.overrides)}`" if plan.overrides else ""
    lines = [
        f"# {' vs '.join(ests)}: held-out success ({cfg.name})",
        "",
        f"Config `{plan.config}`{sets}; model `{cfg.model.name}`; environment `{cfg.env.name}`.",
        f"Seeds {', '.join(map(str, plan.seeds))}; {plan.steps} training steps per run; held-out: {n_games} games of "
        f"split `{cfg.env.val_split}` (sampled with seed {plan.val_seed}, the same for every run), one episode "
        "each per evaluation.",
        "",
        "Held-out success in percent: mean ± sample std over seeds (n = seeds evaluated at that step).",
        "",
        "| step | " + " | ".join(ests) + " |",
        "|---:|" + "---:|" * len(ests),
    ]
    for step in plan.schedule:
        lines.append(f"| {step} | " + " | ".join(_cell(summary["success"][e][str(step)]) for e in ests) + " |")
    cols = list(dict.fromkeys(c for e in ests for c in summary["final_table"][e]))
    lines += ["", f"## Held-out table at step {plan.steps} (percent, mean ± std over seeds)", ""]
    lines += ["| estimator | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for e in ests:
        row = summary["final_table"][e]
        cells = [_cell(row[c], 1.0) if c in row else "–" for c in cols]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    if summary["paired_vs_first"]:
        lines += ["", f"## Paired difference to {ests[0]} at step {plan.steps} (same seed, percentage points)", ""]
        lines += ["| estimator | mean ± std | per seed |", "|---|---:|---|"]
        for e, d in summary["paired_vs_first"].items():
            per = ", ".join(f"{100 * v:+.1f}" for v in d["values"]) or "–"
            lines.append(f"| {e} − {ests[0]} | {_cell(d)} | {per} |")
    lines += ["", "## Training cost", "", "| estimator | wall s / step (mean ± std over seeds) |", "|---|---:|"]
    for e in ests:
        lines.append(f"| {e} | {_cell(seconds[e], 1.0)} |")
    lines += ["", "![held-out success](compare.png)", ""]
    return "\n".join(lines)


def plot(plan: Plan, summary: dict[str, Any], evals: dict[tuple[str, int], dict[int, dict]], path: Path) -> None:
    """compare.png: held-out success over steps, mean line and ±1 std band per estimator, thin lines per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, est in enumerate(plan.estimators):
        color = f"C{i}"
        for s in plan.seeds:
            pts = [(st, v) for st in plan.schedule if (v := _value(evals[(est, s)].get(st))) is not None]
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], color=color, alpha=0.25, linewidth=0.8)
        rows = [(st, summary["success"][est][str(st)]) for st in plan.schedule]
        rows = [(st, d) for st, d in rows if d["n"]]
        xs = [st for st, _ in rows]
        mean = [100 * d["mean"] for _, d in rows]
        std = [100 * (d["std"] or 0.0) for _, d in rows]
        ax.plot(xs, mean, color=color, marker="o", label=f"{est} (mean of {len(plan.seeds)} seeds)")
        lo, hi = [max(0.0, m - s) for m, s in zip(mean, std)], [min(100.0, m + s) for m, s in zip(mean, std)]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out success (%)")
    ax.set_title(f"{plan.base.name}: held-out success (band: ±1 std over seeds, clipped to 0-100)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    config: str | os.PathLike,
    *,
    estimators: Sequence[str] = ("grpo", "alignopsd"),
    seeds: int = 3,
    steps: int,
    eval_every: int | None = None,
    out: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    val_seed: int | None = None,
    first_seed: int | None = None,
    trainer_factory: Callable[[str, list[str]], Any] | None = None,
    stream=None,
) -> dict[str, Any]:
    """Plan, train (or read) every run, write compare.json / compare.md / compare.png; returns compare.json's
    content. ``trainer_factory(config, overrides)`` builds one run's trainer (default: the engine's Trainer)."""
    stream = stream if stream is not None else sys.stdout
    plan = plan_comparison(
        config,
        estimators=estimators,
        seeds=seeds,
        steps=steps,
        eval_every=eval_every,
        out=out,
        overrides=overrides,
        val_seed=val_seed,
        first_seed=first_seed,
    )
    try:
        keys, evals = train_runs(plan, trainer_factory=trainer_factory, stream=stream)
    finally:
        _close_process_group()
    return write_outputs(plan, keys, evals, stream)


def write_outputs(plan: Plan, keys: list[str], evals: dict[tuple[str, int], dict[int, dict]], stream) -> dict:
    """compare.json, compare.md and compare.png of the finished runs (rank 0); returns compare.json's content."""
    summary = summarize(plan, evals)
    seconds = step_seconds(plan)
    result = {
        "config": plan.config,
        "overrides": list(plan.overrides),
        "name": plan.base.name,
        "model": plan.base.model.name,
        "env": plan.base.env.name,
        "val_split": plan.base.env.val_split,
        "val_seed": plan.val_seed,
        "val_tasks": keys,
        "estimators": list(plan.estimators),
        "seeds": list(plan.seeds),
        "steps": plan.steps,
        "eval_every": plan.eval_every,
        "eval_steps": plan.schedule,
        "runs": [
            dict(
                estimator=r.estimator,
                seed=r.seed,
                dir=str(r.out_dir),
                success={str(st): _value(rec) for st, rec in sorted(evals[(r.estimator, r.seed)].items())},
            )
            for r in plan.runs
        ],  # fmt: skip
        **summary,
        "step_seconds": seconds,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        plan.out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(plan.out / "compare.json", json.dumps(result, indent=2).encode())
        atomic_write_bytes(plan.out / "compare.md", markdown(plan, summary, len(keys), seconds).encode())
        plot(plan, summary, evals, plan.out / "compare.png")
        print(f"[compare] wrote {plan.out / 'compare.md'}, compare.json, compare.png", file=stream, flush=True)
    return result


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    from alignopsd.engine.run.trainer import add_run_args

    p = argparse.ArgumentParser(
        prog="alignopsd compare",
        description="Train estimators side by side from the same weights, tasks and seeds; compare held-out success.",
    )
    add_run_args(p)
    p.add_argument("--estimators", default="grpo,alignopsd", help="comma-separated estimators (default grpo,alignopsd)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds: S, S+1, ... (default 3)")
    p.add_argument("--first-seed", type=int, default=None, help="the first seed S (default: trainer.seed)")
    p.add_argument("--steps", type=int, required=True, help="training steps of every run")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="held-out evaluation every K steps, besides before and after training (default steps/10; "
        "0: only before and after)",
    )
    p.add_argument(
        "--val-seed",
        type=int,
        default=None,
        help="seed of the held-out games, one for all runs (default: trainer.seed)",
    )
    p.add_argument("--out", default=None, help="output folder (default runs/compare-<config name>)")
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    from alignopsd.engine.run.checkpoint import UnsafeStateError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(
            args.config,
            estimators=args.estimators.split(","),
            seeds=args.seeds,
            steps=args.steps,
            eval_every=args.eval_every,
            out=args.out,
            overrides=args.overrides,
            val_seed=args.val_seed,
            first_seed=args.first_seed,
        )
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except UnsafeStateError as exc:  # a checkpoint to resume from that fails its checks
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

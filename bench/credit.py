"""Credit-assignment benchmark: GRPO vs AlignOPSD and its ablations on environments with known decision points.

    python -m bench.credit --out bench/results/credit-<date>.md [--seeds 10] [--steps N] [--estimators a,b,...]

Trains the tiny random model (configs/tiny.yaml's run with the benchmark's model, bench/credit_model.py: the
engine's tiny Llama shape with a vocabulary of the environments' words, so every option of a turn has the same
number of tokens and the random initial policy is near-uniform over a turn's actions) with the candidate-choice
generation backend (``generation.backend=choice``) on the ``credit`` environments (engine/envs/credit/env.py) for
every estimator case and seed, each run a real ``Trainer.fit`` with the audit on, and writes the results file and
its plot (same stem, ``.png``): learning curves, steps to 80 % success, areas under the curve, the mechanisms
against the ground truth (bench/credit_metrics.py) and a paired comparison of each estimator with GRPO on the
same seeds.

Run setup (fixed before the first comparison; ``BASE``): 3 tasks per seed (one of each kind, drawn by the seed),
all 3 in every step, G = 4 rollouts each, 8 turns, whole history in the prompt, lr 1e-3, one PPO epoch, no KL
term; the thinking encoder is all-MiniLM-L6-v2 (tiny.yaml's), whose similarities follow the meaning of the
thinking texts. The seed is the trainer's seed: it draws the tasks and the sampling; the model's initial weights
are the same for every seed, so the comparison of two estimators on one seed is paired.

Refusals. A case that does not apply to an environment is refused before anything runs, with its reason (exit
code 2): an environment without ground truth (``decisive_turns``/``true_boundaries``) or without listed
admissible actions, and an estimator with a teacher pass on an environment without a privileged skill bank.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from alignopsd.engine.observe.progress import time_left

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

BASE = [
    "env.max_turns=8",
    "env.history_length=8",
    "env.group_n=4",
    "env.tasks_per_step=3",
    "env.num_games=3",
    "algorithm.kl_coef=0.0",
    "trainer.lr=1e-3",
    "trainer.ppo_mini_batch_size=48",
    "trainer.ppo_micro_batch_size=48",
    "trainer.audit=true",
    "trainer.report=false",
    "trainer.save_freq=-1",
    "generation.backend=choice",
    "encoder.batch_size=256",
]

CASES: dict[str, list[str]] = {
    "grpo": ["algorithm.estimator=grpo"],
    "opsd": ["algorithm.estimator=opsd"],
    "grpo_opsd": ["algorithm.estimator=grpo_opsd"],
    "sdar": ["algorithm.estimator=sdar"],
    "rlsd": ["algorithm.estimator=rlsd"],
    "alignopsd_m1": ["algorithm.estimator=alignopsd_m1"],
    **{f"alignopsd_{ab}": ["algorithm.estimator=alignopsd", f"algorithm.ablation={ab}"] for ab in "ABCD"},
    "alignopsd": ["algorithm.estimator=alignopsd", "algorithm.ablation=E"],
}
# Sizing (CPU seconds per training step of one run, one thread, measured with bench.credit.run_one under nice on
# the shared 2-core machine at a load average of 5-8, so upper bounds): GRPO ~0.7, AlignOPSD ~1.5 (its encoder
# call ~0.5 of it), the teacher-forcing estimators (OPSD, GRPO+OPSD, SDAR, RLSD) assumed ~1.0 (between the two;
# not measured), plus ~0.5 per run to build it. One step of all 11 cases over 10 seeds is then ~137 CPU seconds,
# and 15 minutes on 2 cores (1800 CPU seconds) less ~75 s of run and worker start-up hold ~12.6 steps: the
# default is 12. GRPO alone at lr 1e-3 (seeds 0-2, 15 steps) first reached 80 % at steps 7, 10 and 10.
DEFAULT_STEPS = 12
SIZING = (
    "Fixed in a commit before the first comparison of estimators (the commit line above): the environments, the "
    "metrics, the run setup and the step budget. The setup was sized with GRPO alone and timing-only runs: the "
    "benchmark's model (the engine's tiny Llama shape with a vocabulary of the environments' words, bench/"
    "credit_model.py) replaced the SmolLM2-vocabulary model, whose output layer took >90 % of a step; the "
    "candidate-choice backend scores each prompt once and its candidates on the prompt's key/value cache. CPU "
    "seconds per step of one run, one thread, measured under nice on the shared 2-core machine (load average "
    "5-8; upper bounds): GRPO ~0.7, AlignOPSD ~1.5, teacher-forcing estimators assumed ~1.0. All 11 cases x 10 "
    "seeds cost ~137 CPU s per step plus ~75 s of start-up, so 1800 CPU s (15 min on 2 cores) hold 12 steps. "
    "lr 1e-3 was chosen on GRPO alone (seeds 0-2, 15 steps: 80 % first reached at steps 7, 10, 10; lr 3e-3 "
    "was less stable)."
)
DEFAULT_SEEDS = 10


class Refused(ValueError):
    """A case that does not apply to an environment (the message says why)."""


def refusal(case: str, env: str, skills_dir: str | None = None) -> str | None:
    """Why ``case`` does not apply to ``env`` (None: it applies)."""
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.envs import registry
    from alignopsd.engine.envs.skills import skill_lookup

    from alignopsd.estimators import get_estimator

    if case not in CASES:
        return f"unknown estimator case {case!r}; known: {', '.join(CASES)}"
    entry = registry.get_entry(env)
    module = importlib.import_module(entry.factory.split(":", 1)[0])
    if not (hasattr(module, "decisive_turns") and hasattr(module, "true_boundaries")):
        return f"environment {env!r} reports no ground truth (decisive turns and decision-span boundaries)"
    if not entry.admissible_check:
        return f"environment {env!r} lists no admissible actions, which the candidate-choice backend samples among"
    cfg = load_config(str(TINY), [f"env.name={env}", *CASES[case]])
    spec = get_estimator(cfg.algorithm.estimator)
    if spec.needs_teacher_diag(cfg.algorithm) and skill_lookup(env, skills_dir) is None:
        where = f"under {skills_dir}" if skills_dir else "in the packaged skill banks"
        return f"{case} needs a privileged-skill teacher, but environment {env!r} has no skill bank {where}"
    return None


def check_cases(cases: list[str], env: str, skills_dir: str | None = None) -> None:
    """Raise :class:`Refused` naming every case that does not apply, with its reason."""
    bad = [f"{c}: {why}" for c in cases if (why := refusal(c, env, skills_dir)) is not None]
    if bad:
        raise Refused("refused: " + "; ".join(bad))


def run_one(case: str, seed: int, steps: int, env: str, workdir: str, skills_dir: str | None = None) -> dict:
    """Train one (case, seed) run; its success curve, mechanism tallies, CPU and wall seconds. The benchmark's
    model is read from (or first written to) ``workdir``."""
    import torch
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.envs import registry
    from alignopsd.engine.observe.audit_read import read_audit
    from alignopsd.engine.observe.metrics import read_metrics
    from alignopsd.engine.run.trainer import Trainer

    from bench.credit_metrics import mechanism_tallies
    from bench.credit_model import ensure_model

    torch.set_num_threads(1)
    c0, w0 = time.process_time(), time.perf_counter()
    out = Path(workdir) / f"{case}-s{seed}"
    ov = [*BASE, f"model.name={ensure_model(workdir)}", f"env.name={env}", *CASES[case]]
    ov += [f"trainer.seed={seed}", f"trainer.total_steps={steps}"]
    ov += [f"output_dir={out}", *([f"env.skills_dir={skills_dir}"] if skills_dir else [])]
    tr = Trainer(load_config(str(TINY), ov), stream=open(os.devnull, "w"))  # noqa: SIM115 - closed with the run
    tasks = {t.key: t for t in tr.parts.train_tasks}
    tr.fit()
    recs = read_metrics(out / "metrics.jsonl")
    module = importlib.import_module(registry.get_entry(env).factory.split(":", 1)[0])
    tallies = mechanism_tallies(
        read_audit(out / "audit", kind="turn"),
        lambda k: module.decisive_turns(tasks[k]),
        lambda k: module.true_boundaries(tasks[k]),
    )
    shutil.rmtree(out, ignore_errors=True)
    return {
        "case": case,
        "seed": seed,
        "success": [float(r["episode/success_rate"]) for r in recs],
        "tallies": tallies,
        "cpu_s": time.process_time() - c0,
        "wall_s": time.perf_counter() - w0,
    }


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def run_all(cases: list[str], seeds: list[int], steps: int, env: str, jobs: int, skills_dir: str | None = None):
    """Every (case, seed) run, ``jobs`` at a time in spawned worker processes (1 thread each)."""
    from bench.credit_model import ensure_model

    work = [(c, s) for s in seeds for c in cases]
    t0 = time.perf_counter()

    def report(k: int, run: dict) -> dict:  # a line a finished run, with the time left of the whole benchmark
        left = time_left(time.perf_counter() - t0, k, len(work))
        line = f"bench.credit: run {k}/{len(work)}: {run['case']} seed {run['seed']}: final success "
        line += f"{run['success'][-1]:.2f}, {run['wall_s']:.0f}s" + (f", {left}" if left else "")
        print(line, flush=True)
        return run

    with tempfile.TemporaryDirectory(prefix="credit-bench-") as wd:
        ensure_model(wd)  # once, before the workers read it
        if jobs <= 1:
            _init_worker()
            return [report(k + 1, run_one(c, s, steps, env, wd, skills_dir)) for k, (c, s) in enumerate(work)]
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=_init_worker) as ex:
            futs = {ex.submit(run_one, c, s, steps, env, wd, skills_dir): i for i, (c, s) in enumerate(work)}
            runs: list[dict | None] = [None] * len(work)
            for k, f in enumerate(as_completed(futs)):
                runs[futs[f]] = report(k + 1, f.result())
            return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.credit", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results file (markdown); the plot goes beside it (.png)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds 0..N-1 per estimator")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per run")
    p.add_argument("--estimators", default=",".join(CASES), help=f"comma-separated cases of: {', '.join(CASES)}")
    p.add_argument("--env", default="credit", help="environment (needs ground truth: the credit family)")
    p.add_argument("--skills-dir", default=None, help="root of the skill banks (default: the packaged ones)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from bench.credit_report import summarise, write_results

    a = parse_args(argv)
    cases = [c.strip() for c in a.estimators.split(",") if c.strip()]
    try:
        if a.seeds < 1 or a.steps < 1 or a.jobs < 1:
            raise Refused(f"--seeds, --steps and --jobs must be >= 1, got {a.seeds}, {a.steps}, {a.jobs}")
        check_cases(cases, a.env, a.skills_dir)
    except (Refused, ValueError) as exc:
        print(f"bench.credit: {exc}", file=sys.stderr)
        return 2
    load0, w0, c0 = os.getloadavg(), time.perf_counter(), os.times()
    runs = run_all(cases, list(range(a.seeds)), a.steps, a.env, a.jobs, a.skills_dir)
    c1 = os.times()
    raw = Path(a.out).with_suffix(".json")  # the runs first: a summary that fails loses no training
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps({"runs": runs}, default=str) + "\n")
    meta = {
        "argv": ["python -m bench.credit", *(argv if argv is not None else sys.argv[1:])],
        "wall_s": time.perf_counter() - w0,
        "load_before": load0,
        "load_after": os.getloadavg(),
        "cpu_s": (c1.user + c1.system + c1.children_user + c1.children_system)
        - (c0.user + c0.system + c0.children_user + c0.children_system),
        "jobs": a.jobs,
        "steps": a.steps,
        "seeds": a.seeds,
        "env": a.env,
        "sizing": SIZING,
    }
    summary = summarise(runs, cases)
    out = write_results(Path(a.out), summary, runs, meta)
    print(f"bench.credit: wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

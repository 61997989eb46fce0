"""The mechanisms in the paper's outcome regime (issue 58, item 2): paired counterfactual updates on the drift family
from a warmed student at G = 8, with the teacher as it is and with its skill withheld from half of the siblings.

    python -m bench.probe --out bench/results/probe-<date>.md [--readers 5] [--seeds 10] [--batches 2]
        [--warm-steps N] [--sens-seeds N] [--reader-cache DIR] [--reader-steps N] [--jobs 2] [--render JSON]

The measurement is ``alignopsd ablate``'s (engine/run/ablate.py ``paired_updates``: every estimator case's update
from one snapshot on the same batches, its measures in engine/run/ablate_measures.py); this module only arranges it:

1. **Readers**: ``--readers`` tiny models of the drift benchmark's recipe (bench/drift.py ``reader_recipe``, recipe
   seeds 0, 1, ...; cached).
2. **Per (reader, seed) unit**, in a pool of workers (one thread each), seed by seed: the warm-up, GRPO from the
   reader for ``--warm-steps`` training steps (a real ``Trainer.fit``, the run setup below, checkpoint at its end),
   then from that checkpoint, for each arm of :data:`ARMS`, one call of paired updates on ``--batches`` batches (the
   tasks and sampling seeds of the steps after the warm-up) at the paper's γH with every case of :data:`CASES` at the
   paper's T_c and η plus ablation A and the full method at every other (T_c, η) of :data:`M2_GRID`; on the first
   ``--sens-seeds`` seeds of every reader a second call at γH 0.70 (GRPO, A and E at every (T_c, η)). The run's JSON
   is written after every unit; ``--stop-min`` starts no unit after that many minutes (a stopping rule fixed before
   the run, blind to its results).
3. **The report** (bench/probe_report.py): per arm, each case against GRPO; the contrasts of the mechanisms; the
   pre-registered decision on rectification (E − A in the withheld arm at the paper's settings); the sensitivity.

Run setup (``SETUP``, after the drift benchmark's ``credit.BASE`` + ``credit.ENV_BASE["credit_drift"]``): G = 8,
γH = 0.80, T_c = 0.5, η = 0.5, α_max = 0.8, K = 3 (the paper's WebShop/ALFWorld 7B settings; the last three are the
code's defaults), 2 tasks per seed, lr 1e-3 (the tiny model's), no KL term, the audit off.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import credit, drift
from bench import credit_drift as drift_env
from bench import probe_report as report

GROUP_N = 8
SETUP = [f"env.group_n={GROUP_N}", "algorithm.rectify.gamma=0.8", "trainer.audit=false"]
CASES = (
    "grpo",
    "alignopsd_A",
    "alignopsd_B",
    "alignopsd_C",
    "alignopsd_D",
    "alignopsd_m1",
    "opsd",
    "sdar",
    "alignopsd",
)
ARMS = {"teacher": 0, "withheld": GROUP_N // 2}  # arm -> siblings whose teacher prompt lacks the task's skill
PAPER = {"T_c": 0.5, "eta": 0.5, "gamma": 0.8}
GAMMAS = (0.8, 0.7)  # the paper's γH (the main grid) and the code default
M2_GRID = [{"T_c": tc, "eta": eta} for eta in (0.5, 1.0) for tc in (0.5, 0.25, 0.1)]  # the paper's first
M2_CASES = ("alignopsd_A", "alignopsd")  # the cases run at every (T_c, η): Mechanism 2 with and without rectification
KEYS = {
    "T_c": "algorithm.credit.credit_temperature",
    "eta": "algorithm.credit.mixing",
    "gamma": "algorithm.rectify.gamma",
}
DEFAULT_READERS, DEFAULT_SEEDS, DEFAULT_BATCHES, DEFAULT_WARM, DEFAULT_SENS_SEEDS = 5, 10, 2, 2, 1


def case_name(case: str, s: dict) -> str:
    return report.case_name(case, s, PAPER)


def is_paper(s: dict) -> bool:
    return case_name("", s) == ""


def grid_cases(gamma: float) -> list[tuple[str, str, list[str]]]:
    """(name, estimator case, extra overrides) of one call at γH ``gamma``: at the paper's γH every case of
    :data:`CASES` at the paper's T_c and η, at the other only GRPO; then :data:`M2_CASES` at the other (T_c, η)
    (Mechanism 2's settings may differ between the cases of one call, engine/run/ablate.py ``ESTIMATE_ONLY``)."""
    base = CASES if gamma == PAPER["gamma"] else ("grpo",)
    out = [(case_name(c, {**PAPER, "gamma": gamma}), c, []) for c in base]
    for m2 in M2_GRID:
        s = {**m2, "gamma": gamma}
        for c in M2_CASES if not is_paper(s) else ():
            out.append((case_name(c, s), c, [f"{KEYS[k]}={v}" for k, v in m2.items()]))
    return out


def overrides(reader: str, seed: int, skills: str, out: str) -> list[str]:
    """The unit's run setup (every case and the warm-up share it but for the estimator)."""
    base = [*credit.BASE, *credit.ENV_BASE[drift_env.ENV], *SETUP, f"env.name={drift_env.ENV}", f"model.name={reader}"]
    return [*base, f"env.skills_dir={skills}", f"trainer.seed={seed}", f"output_dir={out}"]


def warm_up(ov: list[str], steps: int) -> tuple[Path, list[float]]:
    """GRPO for ``steps`` training steps (a real run); its last checkpoint and its batch success per step."""
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.observe.metrics import read_metrics
    from alignopsd.engine.run.trainer import Trainer

    cfg = load_config(str(credit.TINY), [*ov, *credit.CASES["grpo"], f"trainer.total_steps={steps}"])
    with open(os.devnull, "w") as sink:
        Trainer(cfg, stream=sink).fit()
    out = Path(cfg.output_dir)
    success = [float(r["episode/success_rate"]) for r in read_metrics(out / "metrics.jsonl")]
    return out / "checkpoints" / f"step_{steps:06d}", success


def reduce(res: dict, cases: tuple[str, ...]) -> dict:
    """What the report reads of one ``paired_updates`` result: per batch its groups and each case's measures; and
    whether every update of every batch started from the same restored weights."""
    from alignopsd.engine.run.ablate_measures import CASE_METRICS

    starts = {c["start_hash"] for b in res["per_batch"] for c in b["cases"].values()}
    return {
        "restored": len(starts) == 1,
        "per_batch": [
            {
                "step": b["step"],
                "groups_with_signal": b["groups_with_signal"],
                "groups_without_signal": b["groups_without_signal"],
                "probe_states": b["probe_states"],
                "cases": {n: {k: b["cases"][n][k] for k in CASE_METRICS} for n in cases},
            }
            for b in res["per_batch"]
        ],
    }


def paired(ov: list[str], gamma: float, ckpt: Path, batches: int, withheld: int) -> dict:
    """One ``paired_updates`` call at γH ``gamma`` (:func:`grid_cases`), reduced."""
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.ablate import AblationCase, paired_updates

    cases = grid_cases(gamma)
    ov = [*ov, f"{KEYS['gamma']}={gamma}"]
    built = [AblationCase(n, load_config(str(credit.TINY), [*ov, *credit.CASES[c], *x])) for n, c, x in cases]
    res = paired_updates(built, checkpoint=ckpt, batches=batches, withheld_siblings=withheld, say=lambda _: None)
    return reduce(res, tuple(n for n, _, _ in cases))


def run_unit(reader: str, seed: int, skills: str, warm_steps: int, batches: int, sensitivity: bool) -> dict:
    """One (reader, seed) unit (see the module docstring), in its own scratch folder."""
    import torch

    torch.set_num_threads(1)
    credit.register_envs()
    c0, w0 = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="probe-unit-") as wd:
        ckpt, success = warm_up(overrides(reader, seed, skills, f"{wd}/warm"), warm_steps)
        arms: dict = {}
        for arm, withheld in ARMS.items():
            ov = overrides(reader, seed, skills, f"{wd}/{arm}")
            gammas = GAMMAS if sensitivity else GAMMAS[:1]
            arms[arm] = {f"γH {g}": paired(ov, g, ckpt, batches, withheld) for g in gammas}
    return {
        "reader": Path(reader).name,
        "seed": seed,
        "warm_success": success,
        "arms": arms,
        "cpu_s": time.process_time() - c0,
        "wall_s": time.perf_counter() - w0,
    }


def run_units(units: list[tuple], pool, jobs: int, stop_s: float | None, save) -> list[dict]:
    """The units in order, ``jobs`` at a time in ``pool``'s workers (None: here, one at a time); none starts after
    ``stop_s`` seconds (a stopping rule fixed before the run, blind to its results). ``save(done)`` after each."""
    from concurrent.futures import FIRST_COMPLETED, wait

    t0, done, todo, running = time.perf_counter(), [], list(units), {}

    def finished(r: dict) -> None:
        done.append(r)
        save(done)
        line = f"bench.probe: unit {len(done)}/{len(units)} ({r['reader']}, seed {r['seed']}): {r['wall_s']:.0f}s"
        print(f"{line}, {time.perf_counter() - t0:.0f}s in all", flush=True)

    def may_start() -> bool:
        return bool(todo) and (stop_s is None or time.perf_counter() - t0 < stop_s)

    if pool is None:
        while may_start():
            finished(run_unit(*todo.pop(0)))
        return done
    while may_start() or running:
        while may_start() and len(running) < jobs:
            u = todo.pop(0)
            running[pool.submit(run_unit, *u)] = u
        ready, _ = wait(running, return_when=FIRST_COMPLETED)
        for f in ready:
            running.pop(f)
            finished(f.result())
    return done


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results file (markdown); the run's JSON goes beside it")
    p.add_argument("--readers", type=int, default=DEFAULT_READERS, help="readers (recipe seeds 0..N-1)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="trainer seeds 0..N-1 per reader")
    p.add_argument("--batches", type=int, default=DEFAULT_BATCHES, help="paired batches per unit and arm")
    p.add_argument("--warm-steps", type=int, default=DEFAULT_WARM, help="GRPO steps of the warm-up")
    p.add_argument("--sens-seeds", type=int, default=DEFAULT_SENS_SEEDS, help="seeds per reader of the sensitivity")
    p.add_argument("--reader-cache", default=None, help="folder of the readers' cache (default: the engine's)")
    p.add_argument("--reader-steps", type=int, default=None, help="the readers' training steps (default: recipe's)")
    p.add_argument("--jobs", type=int, default=2, help="units at a time (one thread each)")
    p.add_argument("--stop-min", type=float, default=None, help="start no unit after this many minutes (readers in)")
    p.add_argument("--render", default=None, help="write the results file again from this run's JSON; run nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from bench.provenance import commit_line, machine

    a = parse_args(argv)
    if a.render:
        raw = json.loads(Path(a.render).read_text())
        raw["meta"]["rendered"] = f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {commit_line()}"
        print(f"bench.probe: wrote {report.write_results(Path(a.out), raw['units'], raw['meta'])} from {a.render}")
        return 0
    if min(a.readers, a.seeds, a.batches, a.warm_steps, a.jobs) < 1 or a.sens_seeds < 0:
        print("bench.probe: --readers, --seeds, --batches, --warm-steps, --jobs must be >= 1", file=sys.stderr)
        return 2
    credit.register_envs()
    load0, w0 = os.getloadavg(), time.perf_counter()
    meta = {"argv": ["python -m bench.probe", *(argv if argv is not None else sys.argv[1:])], "commit": commit_line()}
    meta.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": "{}; flags: {}".format(*machine())})
    meta.update({k: getattr(a, k) for k in ("jobs", "readers", "seeds", "batches", "warm_steps", "sens_seeds")})
    meta.update({"stop_min": a.stop_min, "cases": list(CASES), "arms": ARMS, "paper": PAPER, "gammas": list(GAMMAS)})
    meta.update({"m2_grid": M2_GRID, "run_setup": overrides("<reader>", 0, "<bank>", "<out>")[:-3]})
    raw = Path(a.out).with_suffix(".json")
    raw.parent.mkdir(parents=True, exist_ok=True)

    def save(done: list[dict], complete: bool = False) -> None:  # after every unit: a stopped run keeps its units
        now = {"wall_s": time.perf_counter() - w0, "load_before": load0, "load_after": os.getloadavg()}
        now["cpu_s"] = math.fsum(u["cpu_s"] for u in done) + time.process_time()
        raw.write_text(json.dumps({"meta": {**meta, **now, "complete": complete}, "units": done}) + "\n")

    with tempfile.TemporaryDirectory(prefix="probe-skills-") as bank, credit.worker_pool(a.jobs) as pool:
        skills = str(drift_env.write_skill_bank(bank, drift_env.BENCH_RULE))
        recipes = [drift.reader_recipe(s, a.reader_steps) for s in range(a.readers)]
        readers = drift.build_readers(recipes, a.reader_cache, pool)
        meta["reader_s"] = time.perf_counter() - w0
        units = [
            (str(r), s, skills, a.warm_steps, a.batches, s < a.sens_seeds) for s in range(a.seeds) for r in readers
        ]
        stop = a.stop_min * 60 - meta["reader_s"] if a.stop_min else None
        done = run_units(units, pool, a.jobs, stop, save)
    save(done, complete=len(done) == len(units))
    print(f"bench.probe: wrote {report.write_results(Path(a.out), done, json.loads(raw.read_text())['meta'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

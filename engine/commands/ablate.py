"""``alignopsd ablate``: paired counterfactual updates, every estimator's update from one point on one batch.

    alignopsd ablate --config FILE [--checkpoint DIR] [--estimators grpo,alignopsd_A,...,alignopsd] [--batches N]
        [--holdout-tasks K] [--withhold-skill K] [--out FILE] [--set k=v ...]

For each of ``--batches`` rollout batches (batch b: the tasks and sampling seed of training step start + b), every
estimator case (engine/config/cases.py: ``grpo``, ``alignopsd_A`` … ``alignopsd_D``, ``alignopsd`` for ablation E,
``sdar``, …) updates the policy from the same weights, optimizer state and generator states (engine/run/ablate.py),
and the table gives, per case, against the full method (E) and against GRPO: the advantage mass moved, the per-turn
weight divergence, the parameter step and the log-probability change on probe states, each as a mean and a 95 %
t-interval over batches (engine/run/ablate_measures.py says what each is). GRPO and the full method are added to
``--estimators`` when missing. ``--out`` writes the per-batch records and the summary as JSON. ``--withhold-skill K``
is a control, not the paper's method: the teacher prompts of the last K siblings of every task carry the general
skill only, so their teacher's own grade is uninformed where Mechanism 1 should repair it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from alignopsd.engine.commands.options import add_run_args
from alignopsd.engine.config.cases import BASELINE, FULL_METHOD, case_overrides
from alignopsd.engine.config.schema import ConfigError, load_config

DEFAULT_ESTIMATORS = "grpo,alignopsd_A,alignopsd_B,alignopsd_C,alignopsd_D,alignopsd"

COLUMNS = (
    ("mass_moved_vs_full", "mass moved vs E"),
    ("mass_moved_vs_grpo", "mass moved vs GRPO"),
    ("weight_divergence_vs_full", "|Δw| vs E"),
    ("weight_divergence_vs_grpo", "|Δw| vs GRPO"),
    ("param_step", "param step"),
    ("probe_dlogp_abs", "probe |Δlogp|"),
    ("probe_dlogp_toward_better", "probe Δlogp toward better"),
)


def case_list(text: str) -> list[str]:
    """The cases of ``--estimators`` in their order, GRPO first and the full method last when missing."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if BASELINE not in names:
        names.insert(0, BASELINE)
    if FULL_METHOD not in names:
        names.append(FULL_METHOD)
    return names


def json_ready(obj):
    """``obj`` with every non-finite float as None (JSON null: a value that is not defined on that batch)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def _cell(v: dict, nd: int = 3) -> str:
    m, h, n = v["mean"], v["half_width"], v["n"]
    if n == 0 or math.isnan(m):
        return "n/a"
    g = f"{m:.{nd}g}" if abs(m) < 1e-3 and m != 0 else f"{m:.{nd}f}"
    return f"{g} (n={n})" if math.isnan(h) else f"{g} ± {h:.{nd}g}"


def format_table(res: dict) -> str:
    """The summary as a markdown table (cells: mean ± half-width of the interval, or the one batch's value)."""
    s = res["summary"]
    gw, go = s["groups_with_signal"], s["groups_without_signal"]
    kinds = sorted({b["probe_kind"] for b in res["per_batch"]})
    probes = sum(b["probe_states"] for b in res["per_batch"])
    head = [
        f"{res['batches']} batch(es) from {res['checkpoint'] or res['model']} (env {res['env']}, steps "
        f"{res['start_step']}..{res['start_step'] + res['batches'] - 1}); E = {res['full']}, GRPO = {res['grpo']}",
        f"intervals: {res['interval']}",
        *(
            [f"control: the skill withheld from the teacher prompts of the last {res['withheld_siblings']} siblings"]
            if res.get("withheld_siblings")
            else []
        ),
        f"groups (tasks) per batch with outcome signal: {_cell(gw)}; without: {_cell(go)}",
        f"probe states: {', '.join(kinds)} ({probes} over all batches)",
        "",
        "| estimator | " + " | ".join(label for _, label in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    rows = [f"| {n} | " + " | ".join(_cell(v[k]) for k, _ in COLUMNS) + " |" for n, v in s["cases"].items()]
    return "\n".join(head + rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alignopsd ablate",
        description="Paired counterfactual updates: every estimator's update from one point on the same batches.",
    )
    add_run_args(p)
    p.add_argument(
        "--checkpoint", default=None, help="checkpoint directory to start from (default: the config's model)"
    )
    p.add_argument(
        "--estimators",
        default=DEFAULT_ESTIMATORS,
        help=f"comma-separated estimator cases (default {DEFAULT_ESTIMATORS}); grpo and alignopsd are always run",
    )
    p.add_argument("--batches", type=int, default=3, help="rollout batches, one paired comparison each (default 3)")
    p.add_argument(
        "--holdout-tasks",
        type=int,
        default=None,
        help="tasks of each batch held out as probe states where the environment reports no decisive states "
        "(default: a quarter of the batch's tasks)",
    )
    p.add_argument(
        "--withhold-skill",
        type=int,
        default=0,
        metavar="K",
        help="a control, not the paper's method: the last K siblings of every task get a teacher prompt with the "
        "general skill only (default 0: none)",
    )
    p.add_argument("--out", default=None, help="also write the per-batch records and the summary here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.checkpoint.checkpoint import UnsafeStateError
    from alignopsd.engine.checkpoint.manifest import ManifestError
    from alignopsd.engine.config.preflight import preflight
    from alignopsd.engine.run.ablate import AblationCase, paired_updates

    args = build_parser().parse_args(argv)
    try:
        cases = []
        for name in case_list(args.estimators):
            cfg = load_config(args.config, [*args.overrides, *case_overrides(name)])
            preflight(cfg)
            cases.append(AblationCase(name, cfg))
        print(cases[0].cfg.dtype_line(), flush=True)
        res = paired_updates(
            cases,
            checkpoint=args.checkpoint,
            batches=args.batches,
            holdout_tasks=args.holdout_tasks,
            withheld_siblings=args.withhold_skill,
            say=lambda line: print(f"[ablate] {line}", flush=True),
        )
    except (ManifestError, UnsafeStateError) as exc:
        print(f"--checkpoint error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the cases, --batches, --holdout-tasks, a checkpoint that does not fit
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(res), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(json_ready(res), indent=1, allow_nan=False) + "\n")
        print(f"[ablate] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

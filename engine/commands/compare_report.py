"""The summary of ``alignopsd compare``: held-out success over seeds, the paired differences, ``compare.md``
and ``compare.png`` (engine/commands/compare.py writes them)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alignopsd.engine.commands.compare_plan import SUCCESS, Plan
from alignopsd.engine.observe.metrics import read_metrics


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (None below two values) and count of ``values``."""
    vals = [float(v) for v in values]
    return {
        "mean": statistics.fmean(vals) if vals else None,
        "std": statistics.stdev(vals) if len(vals) > 1 else None,
        "n": len(vals),
        "values": vals,
    }


def fmt_percent(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def success_of(rec: dict | None, key: str = SUCCESS) -> float | None:
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
            str(step): spread([v for r in runs if (v := success_of(r.get(step))) is not None]) for step in plan.schedule
        }
        tables = [table_values(plan.base.env.name, r[plan.steps]) for r in runs]
        columns = list(dict.fromkeys(c for t in tables for c in t))
        final_table[est] = {c: spread([t[c] for t in tables if t.get(c) is not None]) for c in columns}
    first = plan.estimators[0]
    paired = {}
    for est in plan.estimators[1:]:
        diffs = []
        for s in plan.seeds:
            a, b = success_of(evals[(first, s)][plan.steps]), success_of(evals[(est, s)][plan.steps])
            if a is not None and b is not None:
                diffs.append(b - a)
        paired[est] = spread(diffs)
    return {"success": success, "final_table": final_table, "paired_vs_first": paired}


def step_seconds(plan: Plan) -> dict[str, dict[str, Any]]:
    """Mean wall seconds per training step of each estimator (over its runs' steps, from their own records)."""
    means = {}
    for spec in plan.runs:
        ys = [success_of(r, "time/step_wall") for r in read_metrics(spec.out_dir / "metrics.jsonl", "train")]
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
            pts = [(st, v) for st in plan.schedule if (v := success_of(evals[(est, s)].get(st))) is not None]
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

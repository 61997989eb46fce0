"""End-of-run report: ``report.md`` with PNG plots (matplotlib, Agg backend).

Inputs are the files a run leaves in its output directory: ``metrics.jsonl`` (train and val
records) and ``span_lengths.json`` (all M2 span lengths of the run). Plots:

* ``reward_success.png``: reward and success rate over steps (validation points overlaid);
* ``gap.png``: mean identity (diagonal) gap vs mean rectified gap over steps;
* ``span_lengths.png``: histogram of M2 span lengths;
* ``phase_costs.png``: mean seconds per step of every profiled phase.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from alignopsd.engine.observe.memory import gib
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.observe.profiler import ALIGNMENT_PHASES, LABELS, PHASES

PLOTS = ("reward_success.png", "gap.png", "span_lengths.png", "phase_costs.png")  # what write_report may draw


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if v is not None and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reward_success(train: list[dict], val: list[dict], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, label in (
        (axes[0], "episode/reward_mean", "reward"),
        (axes[1], "episode/success_rate", "success rate"),
    ):
        xs, ys = _series(train, key)
        ax.plot(xs, ys, marker="o", label="train")
        vx, vy = _series(val, key)
        if vx:
            ax.plot(vx, vy, marker="s", linestyle="--", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gap(train: list[dict], path: Path) -> bool:
    dx, dy = _series(train, "m1/diagonal_gap/mean")
    cx, cy = _series(train, "m1/corrected_gap/mean")
    if not dx and not cx:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(dx, dy, marker="o", label="identity (diagonal) gap δ^diag")
    ax.plot(cx, cy, marker="s", label="rectified gap δ̃")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("mean teacher - student log-prob")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_spans(lengths: list[int], path: Path) -> bool:
    if not lengths:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    hi = max(lengths)
    ax.hist(lengths, bins=range(1, hi + 2), align="left", rwidth=0.8)
    ax.set_xlabel("span length (turns)")
    ax.set_ylabel("spans")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def phase_means(train: list[dict]) -> dict[str, float]:
    out = {}
    for k in PHASES:
        _, ys = _series(train, f"time/{k}")
        out[k] = _mean(ys) or 0.0
    return out


def plot_phases(means: dict[str, float], path: Path) -> bool:
    if not any(means.values()):
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [k for k in PHASES]
    vals = [means[k] for k in names]
    colors = ["tab:orange" if k in ALIGNMENT_PHASES else "tab:blue" for k in names]
    ax.barh([LABELS[k] for k in names], vals, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (orange: alignment phases)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# the rows of the final table: (metric name, label)
FINAL_KEYS = (
    ("episode/reward_mean", "reward"),
    ("episode/success_rate", "success rate"),
    ("episode/valid_action_rate", "valid-action rate"),
    ("episode/turns_mean", "turns / episode"),
    ("actor/loss", "loss"),
    ("actor/grad_norm", "grad norm"),
    ("m1/valid_match_rate", "M1 valid match rate"),
    ("m1/off_turn_match_weight", "off-turn match weight"),
    ("m1/correspondence_confidence_mean", "confidence ρ"),
    ("m2/segment_length_mean", "span length"),
    ("episode/trajectory_length_mean", "trajectory length"),
    ("m1/teacher_at_budget_fraction", "teacher at-budget fraction"),
    ("m2/projection_activation_rate", "projection activity"),
    ("m2/credit_conservation_error_max", "conservation error"),
    ("time/step", "step seconds"),
)


def _fmt(v) -> str:
    if v is None:
        return "–"
    return f"{v:.4g}"


def final_table(train: list[dict], val: list[dict]) -> str:
    """Markdown table of the last training step and the last validation pass."""
    first, last = (train[0], train[-1]) if train else ({}, {})
    lines = ["| metric | first step | last step | last validation |", "|---|---:|---:|---:|"]
    lv = val[-1] if val else {}
    for k, label in FINAL_KEYS:
        if k in last or k in lv:
            lines.append(f"| {label} | {_fmt(first.get(k))} | {_fmt(last.get(k))} | {_fmt(lv.get(k))} |")
    cats = sorted({k for r in (last, lv) for k in r if k.startswith("episode/success/")})
    for k in cats:
        cells = " | ".join(_fmt(r.get(k)) for r in (first, last, lv))
        lines.append(f"| success: {k.split('/')[-1]} | {cells} |")
    return "\n".join(lines)


def heldout_table(
    rows: dict[str, dict], times: dict[str, float] | None = None, peaks: dict[str, int] | None = None
) -> str:
    """Markdown section: held-out success per stage (same games for every row), then the stage times and, when given,
    each stage's peak resident memory (``peaks``: bytes) and the run's.

    ``rows``: stage label -> {"success", "valid", "turns", "episodes"} (None where unknown).
    """
    lines = [
        "## Held-out success by stage",
        "",
        "| stage | episodes | success | valid-action rate | turns / episode |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r.get('episodes', 0)} | {_fmt(r.get('success'))} | {_fmt(r.get('valid'))} | "
            f"{_fmt(r.get('turns'))} |"
        )
    if times and peaks:
        lines += ["", "| stage | seconds | peak resident memory |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:.0f} | {gib(peaks.get(k))} |" for k, v in times.items()]
        lines.append(f"| **total** | **{sum(times.values()):.0f}** | **{gib(max(peaks.values()))}** |")
    elif times:
        lines += ["", "| stage | seconds |", "|---|---:|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in times.items()]
        lines.append(f"| **total** | **{sum(times.values()):.0f}** |")
    return "\n".join(lines)


def report_numbers(out_dir: str | Path) -> dict[str, float]:
    """The numbers of the report of ``out_dir`` for the loggers' summaries: the final table's values
    (``report/{first,last,last_val}/<metric>``), each phase's mean seconds per step (``report/phase/<phase>``) and the
    alignment overhead over GRPO (``report/alignment_overhead``), where the run has them."""
    train = read_metrics(Path(out_dir) / "metrics.jsonl", "train")
    val = read_metrics(Path(out_dir) / "metrics.jsonl", "val")
    rows = {"first": train[0] if train else {}, "last": train[-1] if train else {}, "last_val": val[-1] if val else {}}
    out: dict[str, float] = {}
    for where, rec in rows.items():
        for k, _ in FINAL_KEYS:
            v = rec.get(k)
            if v is not None and math.isfinite(v):
                out[f"report/{where}/{k}"] = float(v)
    means = phase_means(train)
    if any(means.values()):
        out.update({f"report/phase/{k}": v for k, v in means.items()})
        step = _mean(_series(train, "time/step")[1]) or 0.0
        align = sum(means[k] for k in ALIGNMENT_PHASES)
        if step > align:
            out["report/alignment_overhead"] = align / (step - align)
    return out


def report_files(out_dir: str | Path) -> list[Path]:
    """report.md of ``out_dir`` and the plots it shows (the files a logger stores as artifacts)."""
    out_dir = Path(out_dir)
    report = out_dir / "report.md"
    if not report.is_file():
        return []
    return [report] + [out_dir / name for name in PLOTS if (out_dir / name).is_file()]


def write_report(out_dir: str | Path, *, title: str = "AlignOPSD run", extra: str = "") -> Path:
    """Write report.md and its plots into ``out_dir``; returns the report path."""
    out_dir = Path(out_dir)
    train = read_metrics(out_dir / "metrics.jsonl", "train")
    val = read_metrics(out_dir / "metrics.jsonl", "val")
    spans_path = out_dir / "span_lengths.json"
    spans = json.loads(spans_path.read_text()) if spans_path.exists() else []
    md = [f"# {title}", ""]
    md.append(f"{len(train)} training step(s), {len(val)} validation pass(es).")
    md.append("")
    md.append("## Final table")
    md.append("")
    md.append(final_table(train, val))
    md.append("")
    if train:
        plot_reward_success(train, val, out_dir / "reward_success.png")
        md += ["## Reward and success", "", "![reward and success](reward_success.png)", ""]
    if plot_gap(train, out_dir / "gap.png"):
        md += ["## Identity vs rectified gap", "", "![gap](gap.png)", ""]
    if plot_spans(spans, out_dir / "span_lengths.png"):
        md += [f"## Span lengths ({len(spans)} spans)", "", "![span lengths](span_lengths.png)", ""]
    means = phase_means(train)
    if plot_phases(means, out_dir / "phase_costs.png"):
        step = _mean(_series(train, "time/step")[1]) or 0.0
        align = sum(means[k] for k in ALIGNMENT_PHASES)
        md += ["## Phase costs", "", "![phase costs](phase_costs.png)", ""]
        md += ["| phase | s/step | share |", "|---|---:|---:|"]
        for k in PHASES:
            md.append(f"| {LABELS[k]} | {means[k]:.3f} | {100 * means[k] / step if step else 0:.1f}% |")
        md.append(f"| **step** | **{step:.3f}** | 100% |")
        if step > align:
            md += ["", f"Alignment overhead over GRPO: {100 * align / (step - align):.1f}%."]
        md.append("")
    if extra:
        md += [extra, ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return path

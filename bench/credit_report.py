"""Summary, results file and plot of the credit-assignment benchmark (bench/credit.py)."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from collections import defaultdict
from pathlib import Path

from bench.credit_metrics import TARGET, learning_summary, mean_ci, mechanism_metrics, paired

MECH_KEYS = (
    "decisive_share",
    "m2_precision",
    "m2_recall",
    "m2_precision_tol1",
    "m2_recall_tol1",
    "gap_decisive",
    "gap_other",
)


def summarise(runs: list[dict], cases: list[str]) -> dict[str, dict]:
    """Per case: learning summary, per-run mechanism metrics (mean and CI over seeds), paired comparison with GRPO,
    CPU seconds per step."""
    by_case: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in runs:
        by_case[r["case"]][r["seed"]] = r
    out: dict[str, dict] = {}
    for c in cases:
        rs = by_case[c]
        learn = learning_summary({s: r["success"] for s, r in rs.items()})
        mech_runs = [mechanism_metrics(r["tallies"]) for r in rs.values()]
        mech = {k: mean_ci([m[k] for m in mech_runs]) for k in (*MECH_KEYS, "decisive_token_share")}
        cpu = [r["cpu_s"] / max(1, len(r["success"])) for r in rs.values()]
        out[c] = {"learn": learn, "mech": mech, "cpu_per_step": sum(cpu) / len(cpu), "n": len(rs)}
    if "grpo" in out:
        base = out["grpo"]["learn"]["auc_by_seed"]
        for c in cases:
            if c != "grpo":
                out[c]["vs_grpo"] = paired(out[c]["learn"]["auc_by_seed"], base)
    return out


def _f(x: float, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _ci(mc: tuple[float, float], nd: int = 3) -> str:
    m, h = mc
    return "n/a" if math.isnan(m) else (f"{m:.{nd}f}" if math.isnan(h) else f"{m:.{nd}f} ± {h:.{nd}f}")


def _steps(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.1f}"


def plot(summary: dict[str, dict], path: Path) -> None:
    """Mean success per step with the 95 % band, one line per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for c, s in summary.items():
        ps = s["learn"]["per_step"]
        xs = list(range(1, len(ps) + 1))
        m = [p[0] for p in ps]
        h = [0.0 if math.isnan(p[1]) else p[1] for p in ps]
        main = {"grpo": "black", "alignopsd": "tab:red"}.get(c)  # the two compared lines never share a colour
        ax.plot(xs, m, "-" if main else ":", lw=2.5 if main else 1.0, label=c, **({"color": main} if main else {}))
        if main:
            lo, hi = [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)]
            ax.fill_between(xs, lo, hi, alpha=0.15, color=main)
    ax.axhline(TARGET, color="grey", lw=0.5)
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate of the step's rollouts")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _machine() -> tuple[str, bool]:
    try:
        txt = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown", False
    model = next((ln.split(":", 1)[1].strip() for ln in txt.splitlines() if ln.startswith("Model name")), "unknown")
    return model, "avx512_bf16" in txt


def _commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _tables(summary: dict[str, dict]) -> list[str]:
    lines = [
        "## Learning",
        "",
        "| estimator | AUC (mean ± 95 % CI) | steps to 80 % (median [IQR]) | seeds reaching 80 % | "
        "final-step success | CPU s / step |",
        "|---|---|---|---|---|---|",
    ]
    for c, s in summary.items():
        ln = s["learn"]
        iqr = f"{_steps(ln['steps_to_median'])} [{_steps(ln['steps_to_q1'])}, {_steps(ln['steps_to_q3'])}]"
        lines.append(
            f"| {c} | {_ci(ln['auc'])} | {iqr} | {ln['reached']}/{s['n']} | {_ci(ln['per_step'][-1])} "
            f"| {s['cpu_per_step']:.1f} |"
        )
    n_steps = len(next(iter(summary.values()))["learn"]["per_step"])
    lines += ["", "Success per step (mean ± 95 % CI over seeds):", ""]
    lines += ["| estimator | " + " | ".join(str(i + 1) for i in range(n_steps)) + " |", "|---" * (1 + n_steps) + "|"]
    for c, s in summary.items():
        lines.append(f"| {c} | " + " | ".join(_ci(p, 2) for p in s["learn"]["per_step"]) + " |")
    lines += ["", "## Paired comparison with GRPO (same seeds; difference of AUC, estimator − GRPO)", ""]
    lines += ["| estimator | Δ AUC (mean ± 95 % CI) | wins / losses / ties | sign-test p |", "|---|---|---|---|"]
    for c, s in summary.items():
        if "vs_grpo" in s:
            v = s["vs_grpo"]
            lines.append(
                f"| {c} | {_f(v['diff'])} ± {_f(v['ci'])} | {v['wins']} / {v['losses']} / {v['ties']} "
                f"| {_f(v['p'], 3)} |"
            )
    lines += [
        "",
        "## Mechanisms against the ground truth (mean ± 95 % CI over seeds; all steps of each run)",
        "",
        "| estimator | share of abs. advantage on decisive turns | M2 boundary precision | M2 recall | "
        "precision (±1 turn) | recall (±1 turn) | rectified gap, decisive turns | rectified gap, other turns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, s in summary.items():
        m = s["mech"]
        lines.append(f"| {c} | " + " | ".join(_ci(m[k]) for k in MECH_KEYS) + " |")
    tok = next(iter(summary.values()))["mech"]["decisive_token_share"]
    lines += [
        "",
        f"Decisive turns hold {_ci(tok)} of the response tokens (the share a token-uniform advantage "
        "would put there); GRPO's measured share is the baseline row.",
    ]
    return lines


def _not_better(summary: dict[str, dict]) -> list[str]:
    out = []
    if "alignopsd" not in summary or "grpo" not in summary:
        return out
    a, g = summary["alignopsd"], summary["grpo"]
    v = a.get("vs_grpo")
    if v is not None and not (v["diff"] - v["ci"] > 0):
        out.append(f"- AUC: Δ = {_f(v['diff'])} ± {_f(v['ci'])} (the interval does not lie above 0).")
    sa, sg = a["learn"]["steps_to_median"], g["learn"]["steps_to_median"]
    if not sa < sg:
        out.append(f"- steps to 80 %: median {_steps(sa)} (AlignOPSD) vs {_steps(sg)} (GRPO).")
    fa, fg = a["learn"]["per_step"][-1][0], g["learn"]["per_step"][-1][0]
    if not fa > fg:
        out.append(f"- final-step success: {_f(fa)} (AlignOPSD) vs {_f(fg)} (GRPO).")
    return out


def _mechanism_reading(summary: dict[str, dict]) -> list[str]:
    """AlignOPSD's mechanism metrics next to GRPO's, as a reading of where its update went (computed)."""
    if "alignopsd" not in summary or "grpo" not in summary:
        return []
    a, g = summary["alignopsd"]["mech"], summary["grpo"]["mech"]
    return [
        f"- share of |advantage| on decisive turns: {_ci(a['decisive_share'])} (AlignOPSD) vs "
        f"{_ci(g['decisive_share'])} (GRPO); decisive turns hold {_ci(g['decisive_token_share'])} of the tokens.",
        f"- Mechanism 2's span boundaries against the true ones: precision {_ci(a['m2_precision'])}, recall "
        f"{_ci(a['m2_recall'])} (within one turn: {_ci(a['m2_precision_tol1'])}, {_ci(a['m2_recall_tol1'])}).",
        f"- Mechanism 1's rectified gap per token: {_ci(a['gap_decisive'])} on decisive turns, "
        f"{_ci(a['gap_other'])} on the other turns.",
    ]


def _load_reading(before, after) -> str:
    """Whether the wall time is this machine's (nothing else ran: 1-minute load average at most the 2 cores the
    runs use, plus half a core of slack) or an upper bound (other work shared the cores)."""
    peak = max(before[0], after[0])
    if peak <= 2.5:
        return f"The machine was otherwise idle (1-minute load average at most {peak:.2f}): the wall time is its own."
    return f"Other work shared the cores (1-minute load average up to {peak:.2f}): the wall time is an upper bound."


def write_results(path: Path, summary: dict[str, dict], runs: list[dict], meta: dict) -> Path:
    """The results markdown, its plot (``path`` with ``.png``) and the raw runs and summary (``.json``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    png = path.with_suffix(".png")
    plot(summary, png)
    cpu, bf16 = _machine()
    lb, la = meta["load_before"], meta["load_after"]
    head = [
        f"# Credit-assignment benchmark ({meta['env']}): GRPO vs AlignOPSD and its ablations",
        "",
        f"- command: `{' '.join(meta['argv'])}`",
        f"- commit: {_commit()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- CPU: {cpu}; avx512_bf16: {'yes' if bf16 else 'no'}; {meta['jobs']} runs at a time, one thread each",
        f"- load average (1/5/15 min) before: {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}; after: "
        f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}",
        f"- wall time: {meta['wall_s'] / 60:.1f} min for {len(runs)} runs ({meta['seeds']} seeds × "
        f"{len(summary)} estimators × {meta['steps']} steps); CPU time of all runs: {meta['cpu_s'] / 60:.1f} min, "
        f"i.e. {meta['cpu_s'] / 60 / 2:.1f} min of wall time on 2 otherwise idle cores. {_load_reading(lb, la)}",
        "",
        f"![success per step]({png.name})",
        "",
    ]
    body = _tables(summary)
    worse = _not_better(summary)
    tail = ["", "## Where AlignOPSD does not beat GRPO (computed)", ""]
    tail += worse or ["- nowhere on AUC, steps to 80 % and final-step success."]
    tail += ["", "AlignOPSD's mechanisms in these runs (computed; mean ± 95 % CI over seeds):", ""]
    tail += _mechanism_reading(summary)
    if meta.get("sizing"):
        tail += ["", "## How the run was sized", "", meta["sizing"]]
    path.write_text("\n".join(head + body + tail) + "\n")
    raw = {"meta": meta, "runs": runs, "summary": summary}
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    return path

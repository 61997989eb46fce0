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

GAP_KEYS = (
    "id_gap_decisive",
    "id_gap_other",
    "abs_id_gap_decisive",
    "abs_id_gap_other",
    "abs_gap_decisive",
    "abs_gap_other",
)
# The paper's ablation (Table 2, WebShop, Qwen2.5-7B; Score / Acc), best first: full method, turn allocation (C), no
# rectification (A), token allocation (B), random allocation (D)
PAPER_ABLATION = (
    ("alignopsd", "full method (E)", "87.9 / 78.9"),
    ("alignopsd_C", "turn allocation (C)", "86.3 / 77.3"),
    ("alignopsd_A", "no rectification (A)", "84.2 / 71.9"),
    ("alignopsd_B", "token allocation (B)", "81.6 / 71.1"),
    ("alignopsd_D", "random allocation (D)", "78.9 / 69.5"),
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
        mech = {k: mean_ci([m[k] for m in mech_runs]) for k in (*MECH_KEYS, *GAP_KEYS, "decisive_token_share")}
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


def _panel(ax, summary: dict[str, dict], title: str) -> None:
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
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate of the step's rollouts")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=2)


def plot(summary: dict[str, dict], path: Path, control: dict[str, dict] | None = None) -> None:
    """Mean success per step with the 95 % band, one line per case; the control in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(summary, "from the reader (credit_rules)"), (control or {}, "random-init control (credit)")]
    panels = [p for p in panels if p[0]]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(8 * max(1, len(panels)), 5), squeeze=False)
    for ax, (summ, title) in zip(axes[0], panels):
        _panel(ax, summ, title)
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


def _tables(summary: dict[str, dict], h: str = "##") -> list[str]:
    lines = [
        f"{h} Learning",
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
    lines += ["", f"{h} Paired comparison with GRPO (same seeds; difference of AUC, estimator − GRPO)", ""]
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
        f"{h} Mechanisms against the ground truth (mean ± 95 % CI over seeds; all steps of each run)",
        "",
        "| estimator | share of abs. advantage on decisive turns | M2 boundary precision | M2 recall | "
        "precision (±1 turn) | recall (±1 turn) | rectified gap, decisive turns | rectified gap, other turns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, s in summary.items():
        m = s["mech"]
        lines.append(f"| {c} | " + " | ".join(_ci(m[k]) for k in MECH_KEYS) + " |")
    lines += [
        "",
        "Teacher–student gaps per response token (all steps): the identity gap δ^diag (the teacher with the skill "
        "against the student on the same prefix) and its magnitude Σ|turn sum| / tokens, and the magnitude of the "
        "rectified gap δ̃:",
        "",
        "| estimator | identity gap, decisive | identity gap, other | |identity gap|, decisive | |identity gap|, other "
        "| |rectified gap|, decisive | |rectified gap|, other |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, s in summary.items():
        if not math.isnan(s["mech"]["id_gap_decisive"][0]):
            lines.append(f"| {c} | " + " | ".join(_ci(s["mech"][k]) for k in GAP_KEYS) + " |")
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


def _premise_lines(meta: dict) -> list[str]:
    """The premise before any RL, measured (bench/credit_reader.py), and whether it holds."""
    from bench.credit_reader import PREMISE_MIN, PREMISE_TOL

    prem, rd = meta["premise"], meta["reader"]
    ch, g = prem["choice"], prem["gaps"]
    lines = [
        "## The premise, before any RL",
        "",
        f"The reader (`{rd['folder']}`, recipe below; {rd['seconds']:.0f} s to build or load and verify) on the "
        f"benchmark's tasks (every seed's tasks under the fixed rule {meta['rule']}, decisive turns reached by random "
        f"play, {ch['states']} states): the probability that the candidate-choice policy picks the winning action, "
        "with the skill in its prompt (the teacher's view) and without (the student's). The bridge turn of `agree` "
        "after a mark other than the rule's is left out: no action wins there.",
        "",
        "| kind | states | with the skill | argmax with | without the skill | argmax without | chance |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, c in ((k, v) for k, v in ch.items() if isinstance(v, dict)):
        lines.append(
            f"| {k} | {c['n']} | {_f(c['teacher'])} | {_f(c['teacher_argmax'])} | {_f(c['student'])} "
            f"| {_f(c['student_argmax'])} | {_f(c['chance'])} |"
        )
    lines += [
        "",
        f"Teacher–student gaps per response token on the initial reader (the audit of one AlignOPSD step, seeds "
        f"{prem['gap_seeds']}, computed before its update): identity gap δ^diag {_f(g['id_gap_decisive'])} on "
        f"decisive turns vs {_f(g['id_gap_other'])} on the others, magnitude {_f(g['abs_id_gap_decisive'])} vs "
        f"{_f(g['abs_id_gap_other'])} ({_ratio_text(g['abs_id_gap_decisive'], g['abs_id_gap_other'])}); rectified "
        f"gap δ̃ {_f(g['gap_decisive'])} vs {_f(g['gap_other'])}, magnitude {_f(g['abs_gap_decisive'])} vs "
        f"{_f(g['abs_gap_other'])} ({_ratio_text(g['abs_gap_decisive'], g['abs_gap_other'])}).",
        "",
    ]
    if meta["premise_failures"]:
        lines += [
            f"**The premise does not hold** (needed: with the skill ≥ {PREMISE_MIN}, without it chance ± "
            f"{PREMISE_TOL}, every kind and pooled), so no comparison ran:",
            "",
        ]
        lines += [f"- {x}" for x in meta["premise_failures"]]
    else:
        lines += [
            f"**The premise holds** (with the skill ≥ {PREMISE_MIN}, without it chance ± {PREMISE_TOL}, "
            "every kind and pooled)."
        ]
    recipe = ", ".join(f"{k} {v}" for k, v in rd["recipe"].items())
    return lines + ["", f"Reader recipe (bench/credit_reader.py `RECIPE`): {recipe}.", ""]


def _ratio_text(a: float, b: float) -> str:
    if any(isinstance(x, float) and math.isnan(x) for x in (a, b)) or not b:
        return "n/a"
    return f"{a / b:.1f}x on decisive turns"


def _ablation_order(summary: dict[str, dict]) -> list[str]:
    """The paper's ablation order beside this run's (AUC; ranks; pairs ordered as in the paper)."""
    rows = [(c, name, paper) for c, name, paper in PAPER_ABLATION if c in summary]
    if len(rows) < 2:
        return []
    auc = {c: summary[c]["learn"]["auc"] for c, _, _ in rows}
    ours = sorted(auc, key=lambda c: -auc[c][0])
    lines = [
        "## The paper's ablation order beside this run's",
        "",
        "| paper rank | variant | paper (WebShop 7B Score / Acc) | AUC here | rank here |",
        "|---|---|---|---|---|",
    ]
    for i, (c, name, paper) in enumerate(rows):
        lines.append(f"| {i + 1} | {name} (`{c}`) | {paper} | {_ci(auc[c])} | {ours.index(c) + 1} |")
    pairs = [(rows[i][0], rows[j][0]) for i in range(len(rows)) for j in range(i + 1, len(rows))]
    agree = sum(auc[a][0] > auc[b][0] for a, b in pairs)
    sep = sum(auc[a][0] - auc[a][1] > auc[b][0] + auc[b][1] for a, b in pairs)
    lines += [
        "",
        f"{agree} of {len(pairs)} pairs are ordered as in the paper; in {sep} of them the two 95 % intervals do not "
        "overlap.",
    ]
    return lines


def write_results(
    path: Path, summary: dict[str, dict], runs: list[dict], meta: dict, control: dict[str, dict] | None = None
) -> Path:
    """The results markdown, its plot (``path`` with ``.png``) and the raw runs and summary (``.json``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    png = path.with_suffix(".png")
    if summary or control:
        plot(summary, png, control)
    cpu, bf16 = _machine()
    lb, la = meta["load_before"], meta["load_after"]
    n_est = len(summary) + len(control or {})
    head = [
        f"# Credit-assignment benchmark ({meta['env']}): GRPO vs AlignOPSD and its ablations, from a reader",
        "",
        f"- command: `{' '.join(meta['argv'])}`",
        f"- commit: {meta['commit']}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- CPU: {cpu}; avx512_bf16: {'yes' if bf16 else 'no'}; {meta['jobs']} runs at a time, one thread each",
        f"- load average (1/5/15 min) before: {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}; after: "
        f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}",
        f"- wall time: {meta['wall_s'] / 60:.1f} min, reader included; {len(runs)} comparison runs "
        f"({meta['seeds']} seeds × {len(summary)} estimators × {meta['steps']} steps) and the control's "
        f"({meta['control_seeds']} seeds × {n_est - len(summary)} estimators); "
        f"CPU time: {meta['cpu_s'] / 60:.1f} min, i.e. "
        f"{meta['cpu_s'] / 60 / 2:.1f} min of wall time on 2 otherwise idle cores. {_load_reading(lb, la)}",
        "",
    ]
    body = _premise_lines(meta)
    if summary:
        body += [f"![success per step]({png.name})", "", "## From the reader (`credit_rules`, the fixed rule)", ""]
        body += _tables(summary, "###")
        worse = _not_better(summary)
        body += ["", "### Where AlignOPSD does not beat GRPO (computed)", ""]
        body += worse or ["- nowhere on AUC, steps to 80 % and final-step success."]
        body += ["", "AlignOPSD's mechanisms in these runs (computed; mean ± 95 % CI over seeds):", ""]
        body += _mechanism_reading(summary) + [""] + _ablation_order(summary)
    if control:
        body += ["", "## Control: the random-init model on `credit` (the premise fails there)", ""]
        body += _tables(control, "###")
    if meta.get("sizing"):
        body += ["", "## How the run was sized", "", meta["sizing"]]
    path.write_text("\n".join(head + body) + "\n")
    raw = {"meta": meta, "runs": runs, "summary": summary, "control": control or {}}
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    return path

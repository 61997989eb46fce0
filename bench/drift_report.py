"""Summary, results file and plot of the drift benchmark (bench/drift.py), with the ``credit_rules`` family beside it.

Intervals. A run is a (reader, seed) pair: the unit replicated. Each estimator is compared with GRPO on the same
pairs; the difference of areas under the success curve is given over all readers with a hierarchical bootstrap
interval (:func:`two_stage_ci`: readers drawn with replacement, then seeds drawn with replacement within each drawn
reader; :data:`BOOT` resamples, a fixed seed), so the interval holds the readers' variance as well as the seeds', and
per reader (mean and 95 % t-interval over its seeds). Each estimator's own area is given with the same hierarchical
interval.

Reading a comparison (bench/drift_metrics.py): wins / losses / ties over the pairs (a tie is a difference of 0: the
same number of episodes won), the two-sided exact sign test on wins and losses (ties ignored), its p-value adjusted by
Holm over every comparison the file makes (the table against GRPO, the ablation pairs, the mechanism contrasts and the
sensitivity settings), and "separated" only where the interval excludes 0 by more than the area's resolution (one
episode of one step: 1 / (episodes per step × steps)).
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from pathlib import Path

from bench.credit_metrics import learning_summary, mean_ci, mechanism_metrics, sign_test_p
from bench.credit_report import PAPER_ABLATION
from bench.drift_metrics import auc_resolution, holm, pool, premise_metrics, separated
from bench.provenance import machine

BOOT = 2000
# the paper's numbers beside the premise (../seeds: paper summary)
PAPER_PREMISE = {
    "displacement_median": "4 (WebShop, after entity matching; 79.72 % of correspondences on different turns)",
    "off_turn_weight": "0.967 ALFWorld, 0.836 WebShop, 0.227 Search-QA",
    "off_turn_weight_decisive": "not reported",
    "coverage": "0.452 (matcher's coverage of target turns)",
    "match_precision": "not reported",
    "match_precision_decisive": "not reported",
    "true_span_mean": "not reported (the paper has no ground truth)",
    "learned_span_mean": "4.41 ALFWorld, 3.92 WebShop, 2.24 Search-QA",
}
NOT_TALLIED = "not tallied by this run (its records predate the tally)"
MECHANISM_PAIRS = (
    ("alignopsd", "alignopsd_A", "rectification (E - A)"),
    ("alignopsd", "alignopsd_C", "spans against turn allocation (E - C)"),
    ("alignopsd", "alignopsd_B", "spans against token allocation (E - B)"),
    ("alignopsd", "alignopsd_D", "learned against random spans (E - D)"),
    ("alignopsd_m1", "sdar", "Mechanism 1 alone against SDAR"),
)


def unit(run: dict) -> str:
    return f"{run['model']}:{run['seed']}"


def two_stage_ci(diffs: dict[str, float], n: int = BOOT, seed: int = 0) -> tuple[float, float]:
    """95 % hierarchical bootstrap interval of the mean of ``diffs`` (keyed ``reader:seed``): each resample draws the
    readers with replacement, then, within each drawn reader, its seeds with replacement (percentile interval)."""
    by_reader: dict[str, list[float]] = defaultdict(list)
    for k, v in diffs.items():
        by_reader[k.rsplit(":", 1)[0]].append(v)
    readers = sorted(by_reader)
    if not readers or sum(len(v) for v in by_reader.values()) < 2:
        return float("nan"), float("nan")
    rng, means = random.Random(seed), []
    for _ in range(n):
        vals: list[float] = []
        for r in (rng.choice(readers) for _ in readers):
            xs = by_reader[r]
            vals += [rng.choice(xs) for _ in xs]
        means.append(sum(vals) / len(vals))
    means.sort()
    return means[int(0.025 * n)], means[min(n - 1, int(0.975 * n))]


def compare(ours: dict[str, float], base: dict[str, float]) -> dict:
    """Paired difference on the runs both have: mean, hierarchical interval, per reader mean ± t-interval, wins /
    losses / ties and the two-sided sign test's p (ties ignored); ``p_holm`` is added over the file's family
    (:func:`comparison_family`)."""
    keys = sorted(set(ours) & set(base))
    d = {k: ours[k] - base[k] for k in keys}
    lo, hi = two_stage_ci(d)
    per_reader: dict[str, list[float]] = defaultdict(list)
    for k, v in d.items():
        per_reader[k.rsplit(":", 1)[0]].append(v)
    wins, losses = sum(v > 1e-12 for v in d.values()), sum(v < -1e-12 for v in d.values())
    return {
        "n": len(d),
        "diff": sum(d.values()) / len(d) if d else float("nan"),
        "lo": lo,
        "hi": hi,
        "per_reader": {r: mean_ci(v) for r, v in sorted(per_reader.items())},
        "wins": wins,
        "losses": losses,
        "ties": len(d) - wins - losses,
        "p": sign_test_p(wins, losses),
    }


def summarise(runs: list[dict], cases: list[str]) -> dict[str, dict]:
    """Per case: learning summary over (reader, seed) runs, mechanism and premise metrics pooled over its runs, and
    the paired comparison with GRPO."""
    by_case: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in runs:
        by_case[r["case"]][unit(r)] = r
    out: dict[str, dict] = {}
    for c in cases:
        rs = by_case.get(c) or {}
        if not rs:
            continue
        learn = learning_summary({u: r["success"] for u, r in rs.items()})
        mech: dict[str, float] = {}
        for r in rs.values():
            for k, v in r["tallies"].items():
                mech[k] = mech.get(k, 0.0) + v
        out[c] = {
            "learn": learn,
            "mech": mechanism_metrics(mech),
            "structure": premise_metrics(pool(r["premise"] for r in rs.values() if r.get("premise"))),
            "cpu_per_step": sum(r["cpu_s"] / max(1, len(r["success"])) for r in rs.values()) / len(rs),
            "n": len(rs),
            "auc_ci": two_stage_ci(learn["auc_by_seed"]),  # the area's own interval, over readers and seeds
        }
    if "grpo" in out:
        for c in out:
            if c != "grpo":
                out[c]["vs_grpo"] = compare(out[c]["learn"]["auc_by_seed"], out["grpo"]["learn"]["auc_by_seed"])
    return out


def _f(x, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.{nd}f}"


def _p(x, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _cmp_text(v: dict) -> str:
    return f"{_f(v['diff'])} [{_f(v['lo'])}, {_f(v['hi'])}]"


def _wlt(v: dict) -> str:
    return f"{v['wins']} / {v['losses']} / {v['ties']}"


def _pv(p) -> str:
    return "n/a" if p is None else (f"{p:.1e}" if p < 1e-3 else f"{p:.3f}")


def _sign(v: dict) -> str:
    return f"{_pv(v['p'])} ({_pv(v.get('p_holm'))})"


def _separated(v: dict, resolution: float) -> str:
    return {None: "n/a", True: "yes", False: "no"}[separated(v["lo"], v["hi"], resolution)]


def episodes_per_step(run_setup: list[str]) -> int:
    """Episodes of one training step under the run setup (overrides of configs/tiny.yaml): tasks × siblings."""
    from alignopsd.engine.config.schema import load_config

    from bench.credit import TINY

    cfg = load_config(str(TINY), list(run_setup))
    return cfg.env.tasks_per_step * cfg.env.group_n


def sensitivity(sruns: list[dict], runs: list[dict], meta: dict) -> tuple[str, list[int], dict, dict, dict[str, dict]]:
    """(the reader, its seeds, the reference's AUC by run, {setting: its AUC by run}, {setting: comparison with the
    reference}) of the sensitivity runs: AlignOPSD at one setting changed, paired with the comparison's AlignOPSD on
    the same seeds."""
    reader = meta["readers"][0]["folder"]
    seeds = sorted({r["seed"] for r in sruns})
    base = {unit(r): sum(r["success"]) / len(r["success"]) for r in runs if r["case"] == "alignopsd"}
    base = {k: v for k, v in base.items() if k.startswith(reader + ":") and int(k.rsplit(":", 1)[1]) in seeds}
    by: dict[str, dict[str, float]] = defaultdict(dict)
    for r in sruns:
        by[r["extra"][0]][unit(r)] = sum(r["success"]) / len(r["success"])
    return reader, seeds, base, by, {setting: compare(vals, base) for setting, vals in by.items()}


def comparison_family(summary: dict[str, dict], sens: dict[str, dict]) -> dict[str, dict]:
    """Every comparison the file makes, once each (``"a - b"``: the table against GRPO, the paper's ablation pairs,
    the mechanism contrasts, the sensitivity settings against their reference), each with its Holm-adjusted sign-test
    p-value over the whole family (``p_holm``, set in place)."""
    fam = {f"{c} - grpo": s["vs_grpo"] for c, s in summary.items() if "vs_grpo" in s}
    auc = {c: summary[c]["learn"]["auc_by_seed"] for c in summary}
    rows = [c for c, _, _ in PAPER_ABLATION if c in summary]
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :]]
    pairs += [(a, b) for a, b, _ in MECHANISM_PAIRS if a in auc and b in auc]
    for a, b in pairs:
        if f"{a} - {b}" not in fam:
            fam[f"{a} - {b}"] = compare(auc[a], auc[b])
    fam.update({f"{setting} - reference": v for setting, v in sens.items()})
    for k, p in holm({k: v["p"] for k, v in fam.items()}).items():
        fam[k]["p_holm"] = p
    return fam


def _premise_lines(meta: dict) -> list[str]:
    prem, th = meta["premise"], meta["thresholds"]
    lines = ["## The premise (before any comparison)", ""]
    if meta["premise_failures"]:
        lines += ["**The premise does not hold.** Where:", ""] + [f"- {w}" for w in meta["premise_failures"]] + [""]
        if meta["ignore_premise"]:
            lines += ["The comparison below ran anyway (`--ignore-premise`): read it with that in mind.", ""]
        else:
            lines += ["No comparison ran.", ""]
    else:
        lines += ["The premise holds on every reader.", ""]
    lines += [
        "The winning action's probability on decisive turns reached by random play (the candidate-choice backend's "
        "scoring), with the skill (teacher) and without (student); chance beside it:",
        "",
        "| reader | kind | states | with the skill | without | chance |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in prem["readers"].items():
        for kind, c in p["choice"].items():
            if isinstance(c, dict):
                lines.append(
                    f"| {name} | {kind} | {c['n']} | {_p(c.get('teacher'))} | {_p(c.get('student'))} | "
                    f"{_p(c['chance'])} |"
                )
    s = prem["structure"]
    off_dec = _p(s["off_turn_weight_decisive"]) if "off_turn_weight_decisive" in s else NOT_TALLIED
    lines += [
        "",
        f"From one-step AlignOPSD runs ({len(prem['gap_seeds'])} seeds per reader; the audit of that step is computed "
        "on the reader's weights), against the environment's ground truth, pooled over readers (per reader in the "
        "JSON):",
        "",
        "| quantity | here | threshold | paper |",
        "|---|---|---|---|",
        f"| displacement of the decision across siblings, median (mean; pairs) | {_p(s['displacement_median'], 1)} "
        f"({_p(s['displacement_mean'], 2)}; {int(s['displacement_pairs'])}) | >= {th['displacement']} | "
        f"{PAPER_PREMISE['displacement_median']} |",
        f"| Mechanism 1's off-turn match weight | {_p(s['off_turn_weight'])} | >= {th['off_turn']} | "
        f"{PAPER_PREMISE['off_turn_weight']} |",
        f"| ... on decisive targets | {off_dec} | - | {PAPER_PREMISE['off_turn_weight_decisive']} |",
        f"| coverage (targets with a kept source) | {_p(s['coverage'])} | - | {PAPER_PREMISE['coverage']} |",
        f"| match precision (ω on sources of the same functional decision) | {_p(s['match_precision'])} | - | "
        f"{PAPER_PREMISE['match_precision']} |",
        f"| ... on decisive targets | {_p(s['match_precision_decisive'])} | - | "
        f"{PAPER_PREMISE['match_precision_decisive']} |",
        f"| true span length, mean | {_p(s['true_span_mean'], 2)} | {th['true_span'][0]}-{th['true_span'][1]} | "
        f"{PAPER_PREMISE['true_span_mean']} |",
        f"| Mechanism 2's learned span length, mean | {_p(s['learned_span_mean'], 2)} | - | "
        f"{PAPER_PREMISE['learned_span_mean']} |",
        f"| groups whose siblings all won or all lost | {_p(s['uniform_group_share'])} | - | - |",
    ]
    return lines


def _comparison_lines(summary: dict[str, dict], no_drift: dict, fam: dict[str, dict], res: float) -> list[str]:
    lines = [
        "## Both families: each estimator against GRPO (difference of AUC, paired)",
        "",
        "`credit_rules`: no drift, one-turn decisions at turns the task fixes (its committed results: one reader, "
        "95 % t-interval over 10 seeds). `credit_drift`: this run, every (reader, seed) pair; the intervals of the "
        f"AUC and of its difference are hierarchical bootstraps ({BOOT} resamples: the readers drawn with "
        "replacement, then the seeds with replacement within each drawn reader), per reader a 95 % t-interval over "
        "its seeds. W / L / T: pairs where the estimator's AUC is above / below / equal to GRPO's; sign p: the "
        f"two-sided exact sign test on W and L (ties ignored), in brackets Holm-adjusted over the {len(fam)} "
        f"comparisons of this file. Separated: the interval excludes 0 by more than the AUC's resolution, {res:.4f} "
        "(one episode of one step); a bound within one resolution unit of 0 is not a separation.",
        "",
        "| estimator | AUC (drift) [95 % CI] | drift: - GRPO [95 % CI] | W / L / T | sign p (Holm) | separated | "
        "per reader (drift) | no drift: - GRPO ± CI |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, s in summary.items():
        lo, hi = s["auc_ci"]
        auc = f"{_p(s['learn']['auc'][0])} [{_p(lo)}, {_p(hi)}]"
        nd = (no_drift.get(c) or {}).get("vs_grpo")
        nd_text = f"{_f(nd['diff'])} ± {_p(nd['ci'])}" if nd else ("(baseline)" if c == "grpo" else "n/a")
        if c == "grpo":
            lines.append(f"| {c} | {auc} | (baseline) | - | - | - | - | {nd_text} |")
            continue
        v = fam[f"{c} - grpo"]
        per = "; ".join(f"{_f(m)} ± {_p(h)}" for m, h in v["per_reader"].values())
        lines.append(
            f"| {c} | {auc} | {_cmp_text(v)} | {_wlt(v)} | {_sign(v)} | {_separated(v, res)} | {per} | {nd_text} |"
        )
    return lines


def _pairs_lines(summary: dict[str, dict], no_drift: dict, fam: dict[str, dict], res: float) -> list[str]:
    rows = [c for c, _, _ in PAPER_ABLATION if c in summary]
    lines = [
        "## The paper's ablation order beside ours (drift)",
        "",
        "Paper (WebShop 7B, Score / Acc): " + " > ".join(f"{n} {p}" for _, n, p in PAPER_ABLATION) + ".",
        "",
        "| pair (paper: first > second) | drift: first - second [95 % CI] | W / L / T | sign p (Holm) | "
        "in the paper's order | separated |",
        "|---|---|---|---|---|---|",
    ]
    agree = sep = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            v = fam[f"{a} - {b}"]
            ok, s = v["diff"] > 0, _separated(v, res)
            agree, sep = agree + ok, sep + (s == "yes")
            lines.append(f"| {a} > {b} | {_cmp_text(v)} | {_wlt(v)} | {_sign(v)} | {'yes' if ok else 'no'} | {s} |")
    n = len(rows) * (len(rows) - 1) // 2
    lines += [
        "",
        f"{agree} of {n} pairs in the paper's order; {sep} of {n} separated (the interval excludes 0 by more than "
        f"the resolution {res:.4f}).",
    ]
    lines += ["", "## Where each mechanism helps (paired differences of AUC)", ""]
    lines += [
        "| contrast | drift [95 % CI] | W / L / T | sign p (Holm) | separated | no drift (difference of means) |",
        "|---|---|---|---|---|---|",
    ]
    for a, b, name in MECHANISM_PAIRS:
        if f"{a} - {b}" in fam:
            v = fam[f"{a} - {b}"]
            nd = [no_drift.get(x, {}).get("learn", {}).get("auc", [float("nan")])[0] for x in (a, b)]
            lines.append(
                f"| {name} | {_cmp_text(v)} | {_wlt(v)} | {_sign(v)} | {_separated(v, res)} | {_f(nd[0] - nd[1])} |"
            )
    return lines


def _mechanism_lines(summary: dict[str, dict]) -> list[str]:
    lines = [
        "## Mechanisms against the ground truth (drift; pooled over each estimator's runs, every step)",
        "",
        "| estimator | |A| on decisive turns | ... in won episodes | ... in lost | decisive tokens | "
        "M2 boundary precision / recall (±1 turn) | learned span | uniform groups | CPU s / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c, s in summary.items():
        m, st = s["mech"], s["structure"]
        lines.append(
            f"| {c} | {_p(m['decisive_share'])} | {_p(st['decisive_share_won'])} | {_p(st['decisive_share_lost'])} | "
            f"{_p(m['decisive_token_share'])} | {_p(m['m2_precision_tol1'])} / {_p(m['m2_recall_tol1'])} | "
            f"{_p(st['learned_span_mean'], 2)} | {_p(st['uniform_group_share'])} | {s['cpu_per_step']:.2f} |"
        )
    return lines


def _sensitivity_lines(sens: tuple, fam: dict[str, dict]) -> list[str]:
    reader, seeds, base, by, settings = sens
    if not settings:
        return []
    m0, h0 = mean_ci(list(base.values()))
    lines = [
        "## Sensitivity (AlignOPSD, drift)",
        "",
        f"Reader {reader}, seeds {seeds}; the comparison's AlignOPSD is the reference: T_c 0.5, γH 0.7 (γH: code "
        "default 0.70; paper Table 6: 0.80) (paper: T_c = 0.5 peaks in all three settings; γH 0.60 -> 0.80 lifts "
        "WebShop 3B from 51.6 % to 69.5 %). One reader: the intervals are 95 % t-intervals over its seeds.",
        "",
        "| setting | AUC mean ± 95 % CI | - reference (paired, mean ± CI over seeds) | W / L / T | sign p (Holm) |",
        "|---|---|---|---|---|",
        f"| T_c 0.5, γH 0.7 (reference) | {_p(m0)} ± {_p(h0)} | - | - | - |",
    ]
    for setting, v in settings.items():
        m, h = mean_ci(list(by[setting].values()))
        dm, dh = v["per_reader"].get(reader, (float("nan"), float("nan")))
        key, _, value = setting.partition("=")
        lines.append(
            f"| {key.rsplit('.', 1)[-1]}={value} | {_p(m)} ± {_p(h)} | {_f(dm)} ± {_p(dh)} | {_wlt(v)} | {_sign(v)} |"
        )
    return lines


def _reading(summary: dict[str, dict], no_drift: dict, fam: dict[str, dict], res: float) -> list[str]:
    """Computed sentences: where AlignOPSD stands against GRPO in each family and the measured reasons."""
    if "alignopsd" not in summary or "grpo" not in summary:
        return []
    v = fam["alignopsd - grpo"]
    st = summary["alignopsd"]["structure"]
    gst = summary["grpo"]["structure"]
    sep = separated(v["lo"], v["hi"], res)
    where = ("above" if v["diff"] > 0 else "below") if sep else "not separated from"
    nd = (no_drift.get("alignopsd") or {}).get("vs_grpo")
    lines = [
        "## Reading (computed from the tables above)",
        "",
        f"- With drift, AlignOPSD is {where} GRPO: {_cmp_text(v)} over {v['n']} (reader, seed) pairs, "
        f"{_wlt(v)} W / L / T, sign p {_sign(v)} (Holm in brackets); separated means the interval clears 0 by more "
        f"than the AUC's resolution {res:.4f}."
        + (f" Without drift (`credit_rules`) it was {_f(nd['diff'])} ± {_p(nd['ci'])}." if nd else ""),
        f"- Groups without signal: {_p(st['uniform_group_share'])} of AlignOPSD's (step, task) groups had siblings "
        f"that all won or all lost (GRPO: {_p(gst['uniform_group_share'])}); there the outcome advantage is zero "
        "and no allocation of credit moves anything.",
        f"- Where the credit went: AlignOPSD put {_p(summary['alignopsd']['mech']['decisive_share'])} of |advantage| "
        f"on decisive turns (GRPO {_p(summary['grpo']['mech']['decisive_share'])}; the decisive turns hold "
        f"{_p(summary['grpo']['mech']['decisive_token_share'])} of the tokens): "
        f"{_p(st['decisive_share_won'])} in won episodes and {_p(st['decisive_share_lost'])} in lost ones.",
    ]
    return lines


def plot(summary: dict[str, dict], no_drift: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c, s in summary.items():
        ys = [m for m, _ in s["learn"]["per_step"]]
        a1.plot(range(1, len(ys) + 1), ys, label=c, lw=2.5 if c in ("grpo", "alignopsd") else 1)
    a1.set(xlabel="step", ylabel="batch success (mean over readers × seeds)", title="credit_drift")
    a1.legend(fontsize=7, ncol=2)
    cs = [c for c in summary if c != "grpo"]
    for k, c in enumerate(cs):
        v = summary[c]["vs_grpo"]
        a2.errorbar([k - 0.15], [v["diff"]], yerr=[[v["diff"] - v["lo"]], [v["hi"] - v["diff"]]], fmt="o", c="C0")
        nd = (no_drift.get(c) or {}).get("vs_grpo")
        if nd:
            a2.errorbar([k + 0.15], [nd["diff"]], yerr=[nd["ci"]], fmt="s", c="C1")
    a2.axhline(0, c="k", lw=0.8)
    a2.set_xticks(range(len(cs)), cs, rotation=60, fontsize=7)
    a2.set(ylabel="AUC - GRPO (95 % CI)", title="drift (circles) and no drift (squares)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _setup(overrides: list[str]) -> str:
    """The overrides as they take effect: one per key, the last value given, in first-given order."""
    eff: dict[str, str] = {}
    for o in overrides:
        k, _, v = o.partition("=")
        eff[k] = v
    return " ".join(f"{k}={v}" for k, v in eff.items())


def _gamma(overrides: list[str]) -> str:
    """The γH the run set (its last ``algorithm.rectify.gamma`` override), else the code default's value."""
    given = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == "algorithm.rectify.gamma"]
    return f"= {given[-1]} in this run" if given else "at the code default"


def load_no_drift(path: Path) -> dict:
    """The ``credit_rules`` comparison's summary from its committed results (empty if the file is missing)."""
    try:
        return json.loads(Path(path).read_text()).get("summary") or {}
    except (OSError, ValueError):
        return {}


def write_results(path: Path, runs: list[dict], sruns: list[dict], meta: dict, no_drift_file: Path) -> Path:
    """The results markdown, its plot (``.png``, when anything was compared) and the JSON (runs and summary)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = summarise(runs, meta["cases"]) if runs else {}
    no_drift = load_no_drift(no_drift_file)
    sens = sensitivity(sruns, runs, meta) if summary and sruns else ("", [], {}, {}, {})
    fam = comparison_family(summary, sens[4]) if summary else {}
    res = auc_resolution(episodes_per_step(meta["run_setup"]), meta["steps"])
    cpu = meta.get("cpu") or "not recorded in the run's JSON (this file was rendered on {}; flags: {})".format(
        *machine()
    )
    lb, la = meta["load_before"], meta["load_after"]
    head = [
        "# Drift benchmark (`credit_drift`): decisions that drift in time and last several turns",
        "",
        f"- command: `{' '.join(meta['argv'])}`",
        f"- commit: {meta['commit']}",
        f"- date: {meta.get('date') or 'not recorded in the run' + chr(39) + 's JSON'}",
        f"- CPU: {cpu}; {meta['jobs']} runs at a time, one thread each",
        f"- load average (1/5/15 min) before: {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}; after: "
        f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}",
        f"- wall time: {meta['wall_s'] / 60:.1f} min (readers: {meta['reader_s'] / 60:.1f} min); CPU time "
        f"{meta['cpu_s'] / 60:.1f} min; {len(runs)} comparison runs ({len(meta['readers'])} readers × "
        f"{meta['seeds']} seeds × {len(summary)} estimators × {meta['steps']} steps), {len(sruns)} sensitivity runs",
        f"- rule: {meta['rule']}; run setup (effective overrides of configs/tiny.yaml): `{_setup(meta['run_setup'])}`",
        f"- γH (algorithm.rectify.gamma) {_gamma(meta['run_setup'])}: code default 0.70; paper Table 6: 0.80",
        *([f"- rendered again from the run's JSON at {meta['rendered']}"] if meta.get("rendered") else []),
        "",
    ]
    body = _premise_lines(meta)
    if summary:
        body += ["", f"![success and differences]({path.with_suffix('.png').name})", ""]
        body += _comparison_lines(summary, no_drift, fam, res) + [""] + _pairs_lines(summary, no_drift, fam, res)
        body += [""] + _mechanism_lines(summary) + [""] + _sensitivity_lines(sens, fam)
        body += [""] + _reading(summary, no_drift, fam, res)
        plot(summary, no_drift, path.with_suffix(".png"))
    body += ["", "## How the run was sized", "", meta["sizing"]]
    path.write_text("\n".join(head + body) + "\n")
    raw = {"meta": meta, "runs": runs, "sensitivity_runs": sruns, "summary": summary}
    raw.update({"comparisons": fam, "auc_resolution": res})
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    return path

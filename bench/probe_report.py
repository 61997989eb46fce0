"""The results file of ``python -m bench.probe`` (bench/probe.py): tables of the paired updates and the pre-registered
decision.

The unit of analysis is one (reader, seed): each measure's mean over the unit's batches (batches where a measure is
undefined, nan, left out). Intervals of a mean or of a paired difference over units:

* **decision interval**: the 95 % Student t-interval over the per-reader means (each reader's mean over its seeds;
  n = readers, n - 1 degrees of freedom). The reader is the top level of the design: its seeds share its weights, so
  they are not independent replicates; with 5 readers this interval has its nominal coverage if the reader means
  are roughly normal, and needs no assumption about the seeds within a reader;
* beside it, the hierarchical bootstrap of bench/drift_report.py (``compare``: readers with replacement, then seeds
  within each; percentile). With 5 readers it is narrower than the t-interval (it uses normal-like quantiles and the
  plug-in variance (n - 1) / n of 5 values), so it under-covers: shown, not decided on;
* W / L / T and the two-sided exact sign test over the units, Holm-adjusted over every sign test of the file.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from alignopsd.engine.observe.intervals import mean_ci

from bench.drift_metrics import holm
from bench.drift_report import compare

TOWARD = "probe_dlogp_toward_better"
COLUMNS = (
    ("mass_moved_vs_grpo", "mass moved vs GRPO"),
    ("mass_moved_vs_full", "mass moved vs E"),
    ("weight_divergence_vs_grpo", "|Δw| vs GRPO"),
    ("param_step", "param step"),
    ("probe_dlogp_abs", "decisive |Δlogp|"),
    (TOWARD, "decisive Δlogp toward better"),
)
CONTRASTS = (
    ("alignopsd", "alignopsd_A", "rectification (E - A)"),
    ("alignopsd_A", "grpo", "Mechanism 2 without rectification (A - GRPO)"),
    ("alignopsd", "alignopsd_C", "spans against turn allocation (E - C)"),
    ("alignopsd", "alignopsd_D", "learned against random spans (E - D)"),
    ("alignopsd", "alignopsd_B", "spans against token allocation (E - B)"),
    ("alignopsd_m1", "grpo", "Mechanism 1 alone (M1 - GRPO)"),
    ("alignopsd_m1", "sdar", "Mechanism 1 alone against SDAR"),
)
CONFIRM_SHARE, REFUTE_SHARE = 0.10, 0.02


def key(u: dict) -> str:
    return f"{u['reader']}:{u['seed']}"


def _mean(xs) -> float:
    v = [x for x in xs if x is not None and not math.isnan(x)]
    return math.fsum(v) / len(v) if v else float("nan")


MAIN = "γH 0.8"  # the call at the paper's γH: the main grid


def values(units: list[dict], arm: str, case: str, metric: str, call: str = MAIN) -> dict[str, float]:
    """{unit: the measure's mean over the unit's batches} of ``case`` in ``arm``, from the unit's ``call`` (the γH of
    a ``paired_updates`` call; units without it are left out)."""
    out = {}
    for u in units:
        part = u["arms"][arm].get(call)
        if part is not None and case in part["per_batch"][0]["cases"]:
            out[key(u)] = _mean(b["cases"][case][metric] for b in part["per_batch"])
    return {k: v for k, v in out.items() if not math.isnan(v)}


def reader_t(vals: dict[str, float]) -> tuple[float, float, float]:
    """(mean, lo, hi): the decision interval (module docstring) of the values keyed ``reader:seed``."""
    by: dict[str, list[float]] = defaultdict(list)
    for k, v in vals.items():
        by[k.rsplit(":", 1)[0]].append(v)
    m, h, _ = mean_ci(_mean(v) for v in by.values())
    return m, m - h, m + h


def difference(units, arm, a: str, b: str, metric: str = TOWARD, call: str = MAIN) -> dict:
    """Paired a − b over the units: ``compare``'s statistics plus the decision interval (``t_lo``, ``t_hi``)."""
    va, vb = values(units, arm, a, metric, call), values(units, arm, b, metric, call)
    out = compare(va, vb)
    _, out["t_lo"], out["t_hi"] = reader_t({k: va[k] - vb[k] for k in set(va) & set(vb)})
    return out


def _f(x: float, nd: int = 4) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x:+.{nd}f}" if abs(x) >= 10 ** (-nd) or x == 0 else f"{x:+.1e}"


def _share(d: float, gain: float) -> str:
    return f"{100 * d / gain:+.1f} %" if gain and not math.isnan(gain) and gain > 0 else "n/a"


def setting_name(s: dict) -> str:
    return f"T_c {s['T_c']}, η {s['eta']}, γH {s['gamma']}"


def case_name(case: str, s: dict, paper: dict) -> str:
    """A case's name at setting ``s``: its own name at the paper's setting, else ``case | setting``."""
    return case if all(s[k] == v for k, v in paper.items()) else f"{case} | {setting_name(s)}"


def sens_rows(meta: dict) -> list[tuple[str, str, str, str, str]]:
    """(call, setting label, E's, A's and the call's GRPO case names) of every sensitivity setting, the paper's
    first."""
    out = []
    for g in meta["gammas"]:
        grpo = case_name("grpo", {**meta["paper"], "gamma": g}, meta["paper"])
        for m2 in meta["m2_grid"]:
            s = {**m2, "gamma": g}
            e, a = (case_name(c, s, meta["paper"]) for c in ("alignopsd", "alignopsd_A"))
            out.append((f"γH {g}", setting_name(s), e, a, grpo))
    return out


def family(units: list[dict], meta: dict) -> dict[tuple, dict]:
    """Every comparison of the file, Holm over their sign tests (``p_holm`` added)."""
    fam: dict[tuple, dict] = {}
    for arm in meta["arms"]:
        for c in meta["cases"]:
            if c != "grpo":
                fam[(arm, c, "grpo", MAIN)] = difference(units, arm, c, "grpo")
        for a, b, _ in CONTRASTS:
            fam.setdefault((arm, a, b, MAIN), difference(units, arm, a, b))
        for call, _, e, a, _ in sens_rows(meta):
            fam.setdefault((arm, e, a, call), difference(units, arm, e, a, call=call))
    adj = holm({k: v["p"] for k, v in fam.items() if not math.isnan(v["p"])})
    for k, v in fam.items():
        v["p_holm"] = adj.get(k, float("nan"))
    return fam


def _cmp_cells(v: dict, gain: float) -> list[str]:
    return [
        f"{_f(v['diff'])} [{_f(v['t_lo'])}, {_f(v['t_hi'])}]",
        f"[{_f(v['lo'])}, {_f(v['hi'])}]",
        _share(v["diff"], gain),
        f"{v['wins']} / {v['losses']} / {v['ties']}",
        f"{v['p']:.3g} ({v['p_holm']:.3g})" if not math.isnan(v["p"]) else "n/a",
    ]


def regime_lines(units: list[dict], meta: dict) -> list[str]:
    warm = [u["warm_success"] for u in units]
    steps = max(len(w) for w in warm)
    curve = ", ".join(f"{_mean(w[i] for w in warm if len(w) > i):.3f}" for i in range(steps))
    out = ["## The regime (a property of the warmed student, not of any estimator)", ""]
    out.append(
        f"Warm-up (GRPO from each reader, {meta['warm_steps']} steps): batch success per step, mean over "
        f"units: {curve}."
    )
    out += [
        "",
        "| arm | mixed groups (siblings' outcomes not all equal) | per unit: min - max | decisive probe states "
        "per batch | every update from the restored weights |",
        "|---|---|---|---|---|",
    ]
    for arm in meta["arms"]:
        fr = []
        for u in units:
            bs = u["arms"][arm][MAIN]["per_batch"]
            mixed = sum(b["groups_with_signal"] for b in bs)
            fr.append(mixed / (mixed + sum(b["groups_without_signal"] for b in bs)))
        probes = _mean(b["probe_states"] for u in units for b in u["arms"][arm][MAIN]["per_batch"])
        ok = all(p["restored"] for u in units for p in u["arms"][arm].values())
        cells = [f"{_mean(fr):.3f}", f"{min(fr):.3f} - {max(fr):.3f}", f"{probes:.1f}", "yes" if ok else "NO"]
        out.append(f"| {arm} | " + " | ".join(cells) + " |")
    return out


def case_lines(units: list[dict], arm: str, cases: list[str], fam: dict) -> list[str]:
    gain = _mean(values(units, arm, "grpo", TOWARD).values())
    out = [f"### Arm `{arm}`: each case's update (means over units)", ""]
    out.append(
        "| case | " + " | ".join(lab for _, lab in COLUMNS) + " | toward better - GRPO [t over readers] | "
        "[bootstrap] | share of GRPO's | W / L / T | sign p (Holm) |"
    )
    out.append("|---|" + "---:|" * (len(COLUMNS) + 5))
    for c in cases:
        cells = [_f(_mean(values(units, arm, c, m).values())) for m, _ in COLUMNS]
        cmp = ["(baseline)", "", "", "", ""] if c == "grpo" else _cmp_cells(fam[(arm, c, "grpo", MAIN)], gain)
        out.append(f"| {c} | " + " | ".join(cells + cmp) + " |")
    out += ["", f"Mechanism contrasts on the decisive states' Δlogp toward better (GRPO's own: {_f(gain)}):", ""]
    out += [
        "| contrast | mean [t over readers] | [bootstrap] | share of GRPO's | W / L / T | sign p (Holm) |",
        "|---|---|---|---|---|---|",
    ]
    for a, b, label in CONTRASTS:
        out.append(f"| {label} | " + " | ".join(_cmp_cells(fam[(arm, a, b, MAIN)], gain)) + " |")
    return out


def decision(units: list[dict], fam: dict, arm: str = "withheld") -> tuple[str, dict]:
    """The pre-registered rule on E − A in the withheld arm at the paper's settings: (verdict, numbers)."""
    v = fam[(arm, "alignopsd", "alignopsd_A", MAIN)]
    gain = _mean(values(units, arm, "grpo", TOWARD).values())
    nums = {"diff": v["diff"], "lo": v["t_lo"], "hi": v["t_hi"], "gain": gain}
    if not gain > 0:
        return "inconclusive (GRPO's own gain is not positive, so the rule's scale is undefined)", nums
    if v["t_lo"] > 0 and v["diff"] >= CONFIRM_SHARE * gain:
        return "confirmed", nums
    if -REFUTE_SHARE * gain <= v["t_lo"] and v["t_hi"] <= REFUTE_SHARE * gain:
        return "refuted", nums
    return "inconclusive (neither the confirmation nor the refutation holds)", nums


def sensitivity_lines(units: list[dict], meta: dict, fam: dict) -> list[str]:
    out = ["## Sensitivity of Mechanism 2 (T_c, η) and of γH", ""]
    out.append(
        "Per setting, on the units that ran it (γH 0.8: every unit, in the main grid's call; γH 0.7: the first "
        f"{meta['sens_seeds']} seed(s) of every reader, a call of its own). E and A are the full method and ablation "
        "A at that setting; GRPO is the call's own."
    )
    out += ["", "| arm | setting | units | E - A toward better [t over readers] | share of GRPO's | sign p (Holm) | "
            "|Δw| E vs GRPO | |Δw| A vs GRPO | mass moved E vs GRPO | mass moved A vs GRPO |",
            "|---|---|---:|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for arm in meta["arms"]:
        for call, label, e, a, grpo in sens_rows(meta):
            v = fam[(arm, e, a, call)]
            if not v["n"]:
                continue
            gain = _mean(values(units, arm, grpo, TOWARD, call).values())
            m = [_mean(values(units, arm, c, "weight_divergence_vs_grpo", call).values()) for c in (e, a)]
            m += [_mean(values(units, arm, c, "mass_moved_vs_grpo", call).values()) for c in (e, a)]
            out.append(
                f"| {arm} | {label} | {v['n']} | {_f(v['diff'])} [{_f(v['t_lo'])}, {_f(v['t_hi'])}] | "
                f"{_share(v['diff'], gain)} | {v['p']:.3g} ({v['p_holm']:.3g}) | "
                + " | ".join(f"{x:.4f}" for x in m)
                + " |"
            )
    return out


def header_lines(meta: dict) -> list[str]:
    la, lb = meta["load_before"], meta["load_after"]
    out = [f"- command: `{' '.join(meta['argv'])}`"]
    again = f"; rendered again {meta['rendered']}" if meta.get("rendered") else ""
    out.append(f"- commit: {meta['commit']}; date: {meta['date']}{again}")
    out.append(f"- CPU: {meta['cpu']}; {meta['jobs']} units at a time, one thread each, `nice -n 5`")
    out.append(
        f"- load average (1/5/15 min) before: {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}; after: "
        f"{lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}"
    )
    out.append(
        f"- wall time: {meta['wall_s'] / 60:.1f} min (readers: {meta['reader_s'] / 60:.1f} min); CPU time "
        f"{meta['cpu_s'] / 60:.1f} min"
    )
    out.append(
        f"- grid: {meta['readers']} readers x {meta['seeds']} seeds x {meta['batches']} batches x "
        f"{len(meta['arms'])} arms x {len(meta['cases'])} cases; sensitivity on {meta['sens_seeds']} seed(s) "
        "per reader"
    )
    out.append(f"- run setup (overrides of configs/tiny.yaml): `{' '.join(meta['run_setup'])}`")
    return out


def write_results(path: Path, units: list[dict], meta: dict) -> Path:
    """Write the results below the pre-registration in ``path``: the pre-registration above the results' heading and
    a closing ``# Reading`` section are kept as they are, the results between them rewritten."""
    arms, cases = list(meta["arms"]), list(meta["cases"])
    fam = family(units, meta)
    verdict, n = decision(units, fam)
    per_reader = defaultdict(int)
    for u in units:
        per_reader[u["reader"]] += 1
    done = f"{len(units)} of {meta['readers'] * meta['seeds']} units finished ({min(per_reader.values())}-"
    done += f"{max(per_reader.values())} seeds per reader)" + (
        ""
        if meta.get("complete", True)
        else f", the rest not started: the stopping rule (`--stop-min {meta['stop_min']}`)"
    )
    short = min(per_reader.values()) < meta["seeds"] or len(per_reader) < meta["readers"]
    lines = [RESULTS_HEADING, "", *header_lines(meta), f"- {done}", "", *regime_lines(units, meta), ""]
    lines += ["## The decision (pre-registered above)", ""]
    lines.append(
        f"E - A on the decisive states' Δlogp toward better, arm `withheld`, paper's settings: "
        f"{_f(n['diff'])}, 95 % t-interval over readers [{_f(n['lo'])}, {_f(n['hi'])}]; GRPO's own gain "
        f"{_f(n['gain'])}; confirmation needs lo > 0 and mean >= {_f(CONFIRM_SHARE * n['gain'])}, refutation "
        f"the interval within ±{abs(REFUTE_SHARE * n['gain']):.4f}. **Rectification claim: {verdict}.**"
    )
    if short:
        lines += ["", f"**Provisional**: {done}; below the issue's minimum of {meta['readers']} readers x "
                  f"{meta['seeds']} seeds, so this verdict is not the pre-registered test's final answer."]  # fmt: skip
    lines += ["", "## Each case and each mechanism, per arm", ""]
    for arm in arms:
        lines += [*case_lines(units, arm, cases, fam), ""]
    lines += sensitivity_lines(units, meta, fam)
    text = path.read_text() if path.exists() else ""
    head = text.split(RESULTS_HEADING, 1)[0].rstrip()
    reading = READING_HEADING + text.split(READING_HEADING, 1)[1] if READING_HEADING in text else ""
    path.write_text((head + "\n\n" if head else "") + "\n".join(lines) + "\n" + ("\n" + reading if reading else ""))
    return path


RESULTS_HEADING = "# Results"
READING_HEADING = "# Reading"  # written by hand after the results; kept when they are rendered again

"""The probe of the mechanisms in the paper's outcome regime (bench/probe.py, bench/probe_report.py): its decision rule
on hand values, and the driver at a tiny size through ``main`` (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import credit_reader  # noqa: E402
from bench import probe_report as report  # noqa: E402


def _units(per_reader: dict[str, list[tuple[float, float, float]]]) -> list[dict]:
    """Units whose withheld arm has one batch with (GRPO, A, E) decisive Δlogp toward better."""
    out = []
    for reader, rows in per_reader.items():
        for seed, (g, a, e) in enumerate(rows):
            cases = {c: {report.TOWARD: v} for c, v in (("grpo", g), ("alignopsd_A", a), ("alignopsd", e))}
            arm = {report.MAIN: {"restored": True, "per_batch": [{"cases": cases}]}}
            out.append({"reader": reader, "seed": seed, "arms": {"withheld": arm}})
    return out


def _verdict(per_reader) -> str:
    units = _units(per_reader)
    fam = {
        ("withheld", "alignopsd", "alignopsd_A", report.MAIN): report.difference(
            units, "withheld", "alignopsd", "alignopsd_A"
        )
    }
    return report.decision(units, fam)[0]


def test_decision_rule_on_hand_values():
    # GRPO's gain 1.0 everywhere; E - A of 0.2 +- a little on every reader: above 10 % and clear of zero
    confirm = {f"r{i}": [(1.0, 0.0, 0.2 + 0.01 * i), (1.0, 0.0, 0.21)] for i in range(5)}
    assert _verdict(confirm) == "confirmed"
    # E - A within +-0.005 on every reader: the interval inside +-2 % of GRPO's gain
    refute = {f"r{i}": [(1.0, 0.0, 0.001 * (i - 2)), (1.0, 0.0, 0.0)] for i in range(5)}
    assert _verdict(refute) == "refuted"
    # clear of zero but below 10 % of GRPO's gain: neither
    small = {f"r{i}": [(1.0, 0.0, 0.05), (1.0, 0.0, 0.051)] for i in range(5)}
    assert _verdict(small).startswith("inconclusive")
    # no gain from GRPO: the rule's scale is undefined
    assert "not positive" in _verdict({f"r{i}": [(-1.0, 0.0, 0.5), (-1.0, 0.0, 0.5)] for i in range(5)})


def test_the_decision_interval_is_over_reader_means():
    vals = {"a:0": 1.0, "a:1": 3.0, "b:0": 2.0, "b:1": 2.0, "c:0": 0.0, "c:1": 2.0}
    m, lo, hi = report.reader_t(vals)  # reader means 2, 2, 1: a t-interval with 2 degrees of freedom
    assert m == pytest.approx(5 / 3) and lo < 5 / 3 < hi
    assert hi - m == pytest.approx(4.303 * (1 / 3**0.5) / 3**0.5, rel=1e-3)  # t(0.975, 2) = 4.303


TINY = dict(credit_reader.RECIPE, episodes=6, steps=2, batch=4, warmup=1)  # cannot learn to read


@pytest.mark.slow
def test_the_probe_at_a_tiny_size(tmp_path, monkeypatch):
    from bench import probe

    monkeypatch.setattr(credit_reader, "RECIPE", TINY)
    monkeypatch.setattr(probe, "M2_GRID", [{"T_c": 0.5, "eta": 0.5}, {"T_c": 0.1, "eta": 1.0}])
    out = tmp_path / "probe.md"
    out.write_text("# Pre-registration\n\nfixed text\n")
    argv = ["--out", str(out), "--readers", "1", "--seeds", "1", "--batches", "1", "--warm-steps", "1"]
    argv += ["--sens-seeds", "1", "--jobs", "1", "--reader-cache", str(tmp_path), "--reader-steps", "2"]
    assert probe.main(argv) == 0
    text = out.read_text()
    assert text.startswith("# Pre-registration\n\nfixed text\n\n# Results")  # the pre-registration is kept
    assert "**Rectification claim: " in text and "### Arm `withheld`" in text
    assert "| withheld | T_c 0.1, η 1.0, γH 0.7 | 1 |" in text and "| teacher | T_c 0.5, η 0.5, γH 0.8 | 1 |" in text
    raw = json.loads(out.with_suffix(".json").read_text())
    (unit,) = raw["units"]
    assert raw["meta"]["complete"] and len(unit["warm_success"]) == 1 and set(unit["arms"]) == {"teacher", "withheld"}
    main = {arm: unit["arms"][arm]["γH 0.8"]["per_batch"] for arm in unit["arms"]}
    for arm, calls in unit["arms"].items():
        assert set(calls) == {"γH 0.8", "γH 0.7"} and all(c["restored"] for c in calls.values())
        (b,) = main[arm]
        assert b["step"] == 1  # the batch after the warm-up
        named = {*probe.CASES, "alignopsd_A | T_c 0.1, η 1.0, γH 0.8", "alignopsd | T_c 0.1, η 1.0, γH 0.8"}
        assert set(b["cases"]) == named and b["cases"]["alignopsd"]["mass_moved_vs_full"] in (0.0, None)
        assert len(calls["γH 0.7"]["per_batch"][0]["cases"]) == 5  # GRPO, A and E at two (T_c, η)
    # GRPO reads no teacher: withholding the skill changes nothing of its own update (the same batch and weights)
    own = ("param_step", "probe_dlogp_abs", "probe_dlogp_toward_better", "mass_moved_vs_grpo")
    g_t, g_w = main["teacher"][0]["cases"]["grpo"], main["withheld"][0]["cases"]["grpo"]
    assert {k: g_t[k] for k in own} == {k: g_w[k] for k in own} and g_t["param_step"] > 0
    assert probe.main(["--render", str(out.with_suffix(".json")), "--out", str(tmp_path / "again.md")]) == 0


def test_the_report_renders_every_table_of_a_run(tmp_path):
    import random

    from alignopsd.engine.run.ablate_measures import CASE_METRICS

    from bench import probe

    rng = random.Random(0)
    meta = {"arms": probe.ARMS, "cases": list(probe.CASES), "paper": probe.PAPER, "gammas": list(probe.GAMMAS)}
    meta.update({"m2_grid": probe.M2_GRID, "sens_seeds": 1, "warm_steps": 2, "readers": 5, "seeds": 2, "batches": 2})
    meta.update({"argv": ["python -m bench.probe"], "commit": "abc", "date": "today", "cpu": "x", "jobs": 2})
    meta.update({"wall_s": 60.0, "reader_s": 6.0, "cpu_s": 100.0, "load_before": [1, 2, 3], "load_after": [1, 2, 3]})
    meta.update({"run_setup": ["env.group_n=8"], "stop_min": None, "complete": True})

    def call(gamma: float) -> dict:
        names = [n for n, _, _ in probe.grid_cases(gamma)]
        batch = lambda: {  # noqa: E731
            "step": 2, "groups_with_signal": 2, "groups_without_signal": 0, "probe_states": 9,
            "cases": {n: {k: rng.gauss(0.1, 0.05) for k in CASE_METRICS} for n in names},
        }  # fmt: skip
        return {"restored": True, "per_batch": [batch(), batch()]}

    units = [
        {"reader": f"r{r}", "seed": s, "warm_success": [0.1, 0.3],
         "arms": {a: {f"γH {g}": call(g) for g in (probe.GAMMAS if s == 0 else probe.GAMMAS[:1])} for a in probe.ARMS}}
        for s in range(2) for r in range(5)
    ]  # fmt: skip
    out = tmp_path / "probe.md"
    report.write_results(out, units, meta)
    text = out.read_text()
    assert "**Rectification claim: " in text and text.count("### Arm `") == 2
    assert "| withheld | T_c 0.1, η 1.0, γH 0.7 | 5 |" in text and "| teacher | T_c 0.25, η 0.5, γH 0.8 | 10 |" in text
    assert "| rectification (E - A) |" in text and "| 1.000 | 1.000 - 1.000 | 9.0 | yes |" in text

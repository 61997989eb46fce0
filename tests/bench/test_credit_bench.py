"""The credit-assignment benchmark command: refusals, and a short run (3 seeds, 2 steps, 2 estimators)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import credit, credit_reader  # noqa: E402


def test_estimator_that_needs_skills_the_env_lacks_is_refused(tmp_path, capsys):
    empty = tmp_path / "skills"
    empty.mkdir()
    assert credit.refusal("grpo", "credit", str(empty)) is None
    why = credit.refusal("opsd", "credit", str(empty))
    assert why is not None and "privileged-skill teacher" in why and "no skill bank" in why
    assert credit.refusal("alignopsd", "credit") is None  # the packaged bank has the credit skills
    assert "no ground truth" in credit.refusal("grpo", "codeword")
    assert "unknown estimator case" in credit.refusal("ppo", "credit")
    out = tmp_path / "r.md"
    rc = credit.main(["--out", str(out), "--estimators", "grpo,opsd,alignopsd", "--skills-dir", str(empty)])
    err = capsys.readouterr().err
    assert rc == 2 and "opsd: opsd needs a privileged-skill teacher" in err and "alignopsd: alignopsd needs" in err
    assert "grpo:" not in err and not out.exists()  # refused before anything runs, nothing skipped silently


TINY_READER = dict(credit_reader.RECIPE, episodes=6, steps=2, batch=4, warmup=1)  # cannot learn to read


@pytest.mark.slow
def test_a_reader_that_cannot_read_stops_the_benchmark_before_any_comparison(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(credit_reader, "RECIPE", TINY_READER)  # 2 training steps: it cannot follow the skill
    out = tmp_path / "credit.md"
    argv = ["--out", str(out), "--seeds", "2", "--steps", "2", "--jobs", "1", "--reader-cache", str(tmp_path)]
    assert credit.main(argv) == 1
    assert "the premise does not hold" in capsys.readouterr().err
    text = out.read_text()
    assert "**The premise does not hold**" in text and "with the skill the winning action has p = " in text
    assert "## From the reader" not in text and "## Control" not in text and not out.with_suffix(".png").exists()
    raw = json.loads(out.with_suffix(".json").read_text())
    assert raw["runs"] == [] and raw["control"] == {} and raw["meta"]["premise"]["choice"]["all"]["n"] > 0
    # the commit is read before the run writes anything (a tracked results file it rewrites is no code change)
    assert f"- commit: {raw['meta']['commit']}\n" in text and raw["meta"]["commit"]


@pytest.mark.slow
def test_short_benchmark_writes_results(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(credit_reader, "RECIPE", TINY_READER)
    monkeypatch.setattr(credit_reader, "premise_failures", lambda choice: [])  # the tiny reader's premise, passed
    monkeypatch.setattr(credit, "CONTROL_SEEDS", 2)  # the control runs the first seeds only
    out = tmp_path / "credit.md"
    argv = ["--out", str(out), "--seeds", "3", "--steps", "2", "--estimators", "grpo,alignopsd", "--jobs", "1"]
    argv += ["--control", "grpo", "--reader-cache", str(tmp_path)]
    assert credit.main(argv) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bench.credit: run ")]
    counts = [x.split(":")[1] for x in lines]  # premise (3 one-step runs), then comparison (6) and control (2)
    assert counts == [f" run {k}/3" for k in (1, 2, 3)] + [f" run {k}/8" for k in range(1, 9)]
    assert all(" credit_rules " in x for x in lines[:9]) and all(" credit grpo " in x for x in lines[9:])
    text = out.read_text()
    assert ("The machine was otherwise idle" in text) != ("the wall time is an upper bound" in text)  # read vs load
    assert out.with_suffix(".png").stat().st_size > 1000 and "![success per step](credit.png)" in text
    assert "| grpo |" in text and "| alignopsd |" in text and "load average" in text
    assert "**The premise holds**" in text and "## Control: the random-init model" in text
    raw = json.loads(out.with_suffix(".json").read_text())
    runs = raw["runs"]
    assert sorted((r["case"], r["seed"]) for r in runs) == [(c, s) for c in ("alignopsd", "grpo") for s in range(3)]
    for r in runs:
        assert len(r["success"]) == 2 and all(0.0 <= x <= 1.0 for x in r["success"])
        t = r["tallies"]
        assert t["tokens_dec"] > 0 and t["tokens_oth"] > t["tokens_dec"]  # few decisive turns among many
        if r["case"] == "alignopsd":  # M2 spans and M1 rectified and identity gaps were read from the audit
            assert t["b_pred"] > 0 and t["b_true"] > 0 and 0 <= t["b_hit"] <= min(t["b_pred"], t["b_true"])
            assert t["gap_tokens_dec"] > 0 and t["gap_tokens_oth"] > 0 and t["idgap_tokens_dec"] > 0
        else:
            assert "b_pred" not in t and "gap_tokens_dec" not in t
    s = raw["summary"]
    assert s["alignopsd"]["vs_grpo"]["n"] == 3 and "vs_grpo" not in s["grpo"]
    assert math.isnan(s["grpo"]["mech"]["m2_precision"][0]) and 0.0 <= s["alignopsd"]["mech"]["m2_recall"][0] <= 1.0
    # three tasks of 8 turns with 1-2 decisive turns each: 4 of 24 turns are decisive
    assert 0.05 < s["grpo"]["mech"]["decisive_token_share"][0] < 0.4
    assert list(raw["control"]) == ["grpo"] and len(raw["control"]["grpo"]["learn"]["per_step"]) == 2
    assert raw["meta"]["control_seeds"] == 2 and "the control's (2 seeds × 1 estimators)" in text
    gaps = raw["meta"]["premise"]["gaps"]
    assert not math.isnan(gaps["abs_id_gap_decisive"]) and not math.isnan(gaps["abs_id_gap_other"])

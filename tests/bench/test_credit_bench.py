"""The credit-assignment benchmark command: refusals, and a short run (3 seeds, 2 steps, 2 estimators)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import credit  # noqa: E402


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


@pytest.mark.slow
def test_short_benchmark_writes_results(tmp_path, capsys):
    out = tmp_path / "credit.md"
    argv = ["--out", str(out), "--seeds", "3", "--steps", "2", "--estimators", "grpo,alignopsd", "--jobs", "1"]
    assert credit.main(argv) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bench.credit: run ")]
    assert [x.split(":")[1] for x in lines] == [f" run {k}/6" for k in range(1, 7)]  # a line a finished run
    assert all(x.endswith(" left") for x in lines[:-1]) and "left" not in lines[-1]
    text = out.read_text()
    assert ("The machine was otherwise idle" in text) != ("the wall time is an upper bound" in text)  # read vs load
    assert out.with_suffix(".png").stat().st_size > 1000 and "![success per step](credit.png)" in text
    assert "| grpo |" in text and "| alignopsd |" in text and "load average" in text
    raw = json.loads(out.with_suffix(".json").read_text())
    runs = raw["runs"]
    assert sorted((r["case"], r["seed"]) for r in runs) == [(c, s) for c in ("alignopsd", "grpo") for s in range(3)]
    for r in runs:
        assert len(r["success"]) == 2 and all(0.0 <= x <= 1.0 for x in r["success"])
        t = r["tallies"]
        assert t["tokens_dec"] > 0 and t["tokens_oth"] > t["tokens_dec"]  # few decisive turns among many
        if r["case"] == "alignopsd":  # M2 spans and M1 rectified gaps were read from the audit
            assert t["b_pred"] > 0 and t["b_true"] > 0 and 0 <= t["b_hit"] <= min(t["b_pred"], t["b_true"])
            assert t["gap_tokens_dec"] > 0 and t["gap_tokens_oth"] > 0
        else:
            assert "b_pred" not in t and "gap_tokens_dec" not in t
    s = raw["summary"]
    assert s["alignopsd"]["vs_grpo"]["n"] == 3 and "vs_grpo" not in s["grpo"]
    assert math.isnan(s["grpo"]["mech"]["m2_precision"][0]) and 0.0 <= s["alignopsd"]["mech"]["m2_recall"][0] <= 1.0
    # three tasks of 8 turns with 1-2 decisive turns each: 4 of 24 turns are decisive
    assert 0.05 < s["grpo"]["mech"]["decisive_token_share"][0] < 0.4

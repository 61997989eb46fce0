"""The drift family (bench/credit_drift.py), its premise metrics (bench/drift_metrics.py) and a short variant of its
benchmark command (bench/drift.py) driven through ``main``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import credit_drift as drift  # noqa: E402
from bench import credit_reader  # noqa: E402
from bench.drift_metrics import pool, premise_metrics, premise_tallies  # noqa: E402
from bench.drift_report import compare, two_stage_ci  # noqa: E402


def play(task, policy):
    """Play one episode with ``policy(info) -> action``; (truths per turn, reward, env)."""
    env = drift.DriftEnv()
    _, info = env.reset(task, 0)
    truths, done, reward = [], False, 0.0
    while not done:
        truths.append(info["truth"])
        res = env.step(policy(info))
        info, done, reward = res.info, res.done, res.reward
    return truths, reward, env


def rule_policy(task, detour: int = 0, sign: int = 0, wrap_other: bool = False):
    """Looks around ``detour`` times, follows sign ``sign``, then plays the rule (or wraps the other colour)."""
    state = {"looked": 0}
    colour = task.payload["answer"]

    def act(info):
        acts = info["admissible_actions"]
        phase = info["truth"]["decision"]
        if phase == "street":
            if state["looked"] < detour:
                state["looked"] += 1
                return "look around"
            return "walk on"
        if phase == "signpost":
            return acts[sign]
        if phase == "wrap" and wrap_other:
            return next(a for a in acts if colour not in a)
        if phase == "home":
            return "walk home"
        return next((a for a in acts if f" {colour} " in a), acts[0])

    return act


def test_the_decision_comes_when_the_agent_gets_there_and_its_three_steps_must_agree():
    task = drift.load_tasks("train", 2, seed=3)[0]
    straight, won, _ = play(task, rule_policy(task))
    late, won_late, _ = play(task, rule_policy(task, detour=3, sign=2))
    first = [k for k, t in enumerate(straight) if t["decision"] == "examine"]
    first_late = [k for k, t in enumerate(late) if t["decision"] == "examine"]
    assert first == [3] and first_late == [6]  # the same decision, three turns later: the agent's own doing
    assert won == won_late == 10.0  # the signpost is a distractor: any sign, the same outcome
    assert [t["goal"] for t in straight] == ["street", "crossroads", "crossroads", "buy", "buy", "buy", "home", "home"]
    assert drift.true_boundaries_of(straight) == [1, 3, 6]
    assert [t["decisive"] for t in straight] == [False] * 3 + [True] * 3 + [False] * 2
    _, lost, env = play(task, rule_policy(task, wrap_other=True))
    assert lost == 0.0 and env.picks[0] == task.payload["answer"] != env.picks[1]  # wrapped another: lost
    assert env.held == env.picks[2]  # the item in hand is the one last handled


def test_the_horizon_ends_an_agent_that_never_gets_there_and_bad_actions_change_nothing():
    task = drift.load_tasks("train", 2, seed=0)[1]
    truths, reward, env = play(task, lambda info: "look around")
    assert len(truths) == drift.HORIZON and reward == 0.0 and env.picks == []
    env = drift.DriftEnv()
    env.reset(task, 0)
    env.step("jump over the moon")
    assert env.t == 1 and env.phase() == "street" and env.pos == 0
    with pytest.raises(ValueError, match="malformed"):
        env.reset(drift.TaskSpec(key="k", env=drift.ENV, category="shop", payload={"options": ["red"]}), 0)


def test_rule_action_follows_the_state_and_is_none_when_the_rule_colour_is_not_offered():
    task = next(t for t in drift.load_tasks("train", 8, seed=1) if t.category == "workshop")
    env = drift.DriftEnv()
    env.reset(task, 0)
    assert env.rule_action() is None  # the street: the rule says nothing
    env.step("walk on")
    env.step(env.actions()[0])  # a sign
    env.step("walk on")
    colour = task.payload["answer"]
    assert env.rule_action() == f"take the {colour} key" == env.winning_action()
    wrong = next(a for a in env.actions() if colour not in a)
    env.step(wrong)
    offered = env.actions()
    assert (env.rule_action() is None) == all(colour not in a for a in offered)
    assert env.winning_action() is None  # a wrong key in hand: nothing wins any more
    assert "use the" in drift.skill_text("workshop", colour) and colour in drift.skill_text("workshop", colour)


def _rec(step, task, rollout, turn, idx, decision, outcome=0.0, sources=(), span_start=None, goal=None):
    rec = {
        "kind": "turn",
        "step": step,
        "rank": 0,
        "canonical_index": idx,
        "task": task,
        "rollout": rollout,
        "turn": turn,
        "outcome": outcome,
        "truth": {"decision": decision, "goal": goal or decision, "decisive": decision in drift.STEPS},
        "regions": {"response": {"tokens": 4, "sum_abs_advantage": 1.0}},
        "m1": {"sources": [{"index": i, "omega": w} for i, w in sources]},
    }
    if span_start is not None:
        rec["m2"] = {"span_start": span_start}
    return rec


def test_premise_tallies_measure_displacement_match_precision_off_turn_weight_and_spans():
    # one task, two siblings: rollout 0 examines at turn 1, rollout 1 at turn 4
    recs = [
        _rec(1, 0, 0, 0, 0, "street", span_start=0),
        _rec(1, 0, 0, 1, 1, "examine", sources=[(3, 0.75), (2, 0.25)], span_start=1),
        _rec(1, 0, 1, 0, 2, "street", outcome=10.0, span_start=0),
        _rec(1, 0, 1, 4, 3, "examine", outcome=10.0, sources=[(1, 1.0)], span_start=0),
    ]
    m = premise_metrics(pool([premise_tallies(recs), premise_tallies(recs)]))
    assert m["displacement_median"] == 3.0 and m["displacement_pairs"] == 2  # |1 - 4|, pooled over two runs
    assert m["match_precision"] == pytest.approx((0.75 + 1.0) / 2.0)  # 0.25 went to a street turn
    assert m["match_precision_decisive"] == pytest.approx(0.875)
    assert m["off_turn_weight"] == pytest.approx((0.75 + 0.25 + 1.0) / 2)  # every source on another turn
    assert m["coverage"] == pytest.approx(0.5)  # the street targets kept no source
    assert m["true_span_mean"] == pytest.approx(1.0) and m["learned_span_mean"] == pytest.approx(4 / 3)
    assert m["uniform_group_share"] == 0.0  # one sibling won, one lost
    assert m["decisive_share_won"] == pytest.approx(0.5) and m["decisive_share_lost"] == pytest.approx(0.5)


def test_two_stage_interval_holds_the_readers_variance():
    same = {f"r{r}:{s}": 0.1 + 0.01 * (s % 2) for r in range(3) for s in range(10)}
    apart = {f"r{r}:{s}": 0.1 * (r - 1) + 0.01 * (s % 2) for r in range(3) for s in range(10)}
    lo1, hi1 = two_stage_ci(same)
    lo2, hi2 = two_stage_ci(apart)
    assert lo1 <= 0.105 <= hi1 and hi1 - lo1 < 0.02
    assert lo2 < 0.0 < hi2 and hi2 - lo2 > 0.1  # readers that disagree widen the interval past zero
    assert two_stage_ci(same) == (lo1, hi1)  # a fixed seed
    v = compare({"a:0": 0.5, "a:1": 0.4}, {"a:0": 0.3, "a:1": 0.4, "b:0": 0.9})
    assert v["n"] == 2 and v["diff"] == pytest.approx(0.1) and (v["wins"], v["losses"]) == (1, 0)


TINY = dict(credit_reader.RECIPE, episodes=6, steps=2, batch=4, warmup=1)  # cannot learn to read


@pytest.mark.slow
def test_short_drift_benchmark_reports_the_premise_and_compares_only_when_told(tmp_path, capsys, monkeypatch):
    from bench import drift as bench_drift

    monkeypatch.setattr(credit_reader, "RECIPE", TINY)
    out = tmp_path / "drift.md"
    base = ["--readers", "2", "--seeds", "2", "--steps", "1", "--jobs", "1", "--reader-cache", str(tmp_path)]
    base += ["--reader-steps", str(TINY["steps"])]
    assert bench_drift.main(["--out", str(out), *base, "--estimators", "grpo,alignopsd"]) == 1
    text = out.read_text()
    assert "**The premise does not hold.**" in text and "No comparison ran." in text and "## Both families" not in text
    assert "displacement of the decision across siblings" in text and "- CPU: " in text and "flags: " in text
    raw = json.loads(out.with_suffix(".json").read_text())
    assert raw["runs"] == [] and len(raw["meta"]["premise"]["readers"]) == 2
    s = raw["meta"]["premise"]["structure"]
    assert s["displacement_pairs"] > 0 and 0.0 <= s["coverage"] <= 1.0 and s["true_span_mean"] > 1.0

    capsys.readouterr()
    argv = ["--out", str(out), *base, "--estimators", "grpo,alignopsd,alignopsd_A", "--sens-seeds", "1"]
    assert bench_drift.main([*argv, "--ignore-premise"]) == 0
    text = out.read_text()
    assert "ran anyway (`--ignore-premise`)" in text and "## Both families" in text and "## Sensitivity" in text
    assert "| alignopsd > alignopsd_A |" in text and "| rectification (E - A) |" in text
    assert out.with_suffix(".png").stat().st_size > 1000
    raw = json.loads(out.with_suffix(".json").read_text())
    units = sorted((r["case"], r["model"], r["seed"]) for r in raw["runs"])
    assert len(units) == 12 and len({u[1] for u in units}) == 2  # 3 cases x 2 readers x 2 seeds
    assert len(raw["sensitivity_runs"]) == 5 and {tuple(r["extra"]) for r in raw["sensitivity_runs"]} == {
        ("algorithm.credit.credit_temperature=0.25",),
        ("algorithm.credit.credit_temperature=1.0",),
        ("algorithm.credit.credit_temperature=2.0",),
        ("algorithm.rectify.gamma=0.6",),
        ("algorithm.rectify.gamma=0.8",),
    }
    for r in raw["runs"]:  # the ground truth reached the bench through the audit's turn records
        assert isinstance(r["premise"]["displacement"], list) and r["premise"]["groups"] == 2  # 2 tasks, 1 step
        assert (r["premise"].get("targets", 0) > 0) == (r["case"] != "grpo")  # M1's targets: not in GRPO
        assert r["tallies"]["tokens_dec"] >= 0 and r["tallies"]["tokens_oth"] > 0
    v = raw["summary"]["alignopsd"]["vs_grpo"]
    assert v["n"] == 4 and not math.isnan(v["diff"])
    again = tmp_path / "again.md"  # the report read again from the run's JSON, nothing run
    assert bench_drift.main(["--render", str(out.with_suffix(".json")), "--out", str(again)]) == 0
    text_again = again.read_text()
    assert "rendered again from the run's JSON" in text_again and "| credit_temperature=0.25 |" in text_again
    assert text_again.split("## The premise")[1].split("![")[0] == text.split("## The premise")[1].split("![")[0]
    assert text_again.split("## Both families")[1] == text.split("## Both families")[1]

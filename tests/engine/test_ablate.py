"""``alignopsd ablate``: paired counterfactual updates from one snapshot (engine/run/ablate.py, its measures, the
snapshot, the command).

The paired runs use tiny.yaml with the guess environment and the candidate-choice generator of ``learn_helpers``
(two turns, 4 tasks of 4 siblings per batch; the environment reports no decisive states, so one task per batch is
held out as the probe states); the decisive states come from the ``credit`` environment (slow).
"""

from __future__ import annotations

import json
import math

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.commands import cli
from alignopsd.engine.commands.ablate import case_list
from alignopsd.engine.config.cases import ESTIMATOR_CASES, case_names, case_overrides
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.observe.intervals import mean_ci, t_quantile_95
from alignopsd.engine.run.ablate import (
    CASE_KEYS,
    AblationCase,
    case_settings,
    check_cases,
    paired_updates,
    probe_states,
)
from alignopsd.engine.run.ablate_measures import (
    mass_moved,
    outcome_groups,
    probe_change,
    toward_better,
    turn_weights,
    weight_divergence,
)
from alignopsd.engine.run.snapshot import weight_hash
from alignopsd.engine.step.batch import TurnBatch

TINY = str(lh.TINY_CONFIG)
GUESS = [*lh.GUESS_OVERRIDES, "generation.backend=choice"]
GRPO = ["algorithm.estimator=grpo"]
FULL = ["algorithm.estimator=alignopsd", "algorithm.ablation=E"]


def _cases(tmp, extra=(), named=(("grpo", GRPO), ("grpo_again", GRPO), ("alignopsd", FULL))):
    lh.register_guess_env()
    base = [*GUESS, f"output_dir={tmp}", *extra]
    return [AblationCase(n, load_config(TINY, [*base, *ov])) for n, ov in named]


# ---------------------------------------------------------------------------------------------------------------------
# paired updates on the tiny model


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    torch.set_num_threads(1)
    return paired_updates(_cases(tmp_path_factory.mktemp("ablate")), batches=2)


def test_identical_estimators_give_identical_updates(paired):
    for b in paired["per_batch"]:
        one, two = b["cases"]["grpo"], b["cases"]["grpo_again"]
        assert one["param_step"] == two["param_step"] > 0  # the update moved the weights, the same way twice
        assert one["end_hash"] == two["end_hash"]
        assert math.isnan(two["mass_moved_vs_grpo"]) or two["mass_moved_vs_grpo"] == 0.0
        assert math.isnan(two["weight_divergence_vs_grpo"]) or two["weight_divergence_vs_grpo"] == 0.0
        assert one["probe_dlogp_abs"] == two["probe_dlogp_abs"]
    assert any(b["groups_with_signal"] for b in paired["per_batch"])  # a batch where the mass is defined


def test_a_known_difference_is_detected(paired):
    mixed = [b for b in paired["per_batch"] if b["groups_with_signal"] > 0]
    assert mixed, "no batch with mixed outcomes: pick another seed for this test"
    for b in mixed:
        full = b["cases"]["alignopsd"]
        assert full["mass_moved_vs_grpo"] > 0 and full["weight_divergence_vs_grpo"] > 0
        assert full["mass_moved_vs_full"] == 0.0
        assert full["end_hash"] != b["cases"]["grpo"]["end_hash"]


def test_every_update_starts_from_the_restored_weights(paired):
    starts = {c["start_hash"] for b in paired["per_batch"] for c in b["cases"].values()}
    assert len(starts) == 1  # every case of every batch, after the first case's update changed the weights
    ends = {c["end_hash"] for b in paired["per_batch"] for c in b["cases"].values()}
    assert not starts & ends


def test_groups_probes_and_summary(paired):
    for b in paired["per_batch"]:
        assert b["tasks"] == 3 and b["groups_with_signal"] + b["groups_without_signal"] == 3  # 4 tasks, 1 held out
        assert b["probe_kind"] == "held-out" and b["probe_states"] == 4 * 2  # the held-out task's 4 episodes x 2 turns
    s = paired["summary"]
    assert s["groups_with_signal"]["n"] == 2
    steps = [b["cases"]["alignopsd"]["param_step"] for b in paired["per_batch"]]
    m, h, n = mean_ci(steps)
    assert s["cases"]["alignopsd"]["param_step"] == {"mean": m, "half_width": h, "n": n}
    assert paired["full"] == "alignopsd" and paired["grpo"] == "grpo" and "t-interval" in paired["interval"]


def test_lora_snapshot_restores_the_adapters(tmp_path):
    torch.set_num_threads(1)
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]
    res = paired_updates(_cases(tmp_path, lora), batches=1)
    cases = res["per_batch"][0]["cases"]
    assert len({c["start_hash"] for c in cases.values()}) == 1
    assert cases["grpo"]["end_hash"] == cases["grpo_again"]["end_hash"] != cases["grpo"]["start_hash"]
    assert cases["grpo"]["param_step"] == cases["grpo_again"]["param_step"] > 0


def test_from_a_checkpoint_with_its_optimizer_state(tmp_path):
    tr, _ = lh.run_tiny(tmp_path / "run", GRPO, steps=1)  # one update: AdamW's moments are in the checkpoint
    trained = weight_hash(tr.parts.policy)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    res = paired_updates(_cases(tmp_path / "ablate"), checkpoint=ckpt, batches=1)
    b = res["per_batch"][0]
    assert res["start_step"] == 1 and b["step"] == 1 and res["checkpoint"] == str(ckpt)
    assert {c["start_hash"] for c in b["cases"].values()} == {trained}
    assert b["cases"]["grpo"]["end_hash"] == b["cases"]["grpo_again"]["end_hash"] != trained


def test_cli_table_and_json(tmp_path, capsys):
    lh.register_guess_env()
    out = tmp_path / "ablate.json"
    sets = [a for o in [*GUESS, f"output_dir={tmp_path}"] for a in ("--set", o)]
    rc = cli.main(["ablate", "--config", TINY, *sets, "--estimators", "alignopsd_C", "--batches", "1",
                   "--out", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "| estimator | mass moved vs E |" in text and "| alignopsd_C |" in text
    data = json.loads(out.read_text())  # strict JSON: undefined values are null
    assert list(data["cases"]) == ["grpo", "alignopsd_C", "alignopsd"]  # GRPO and the full method added
    assert data["cases"]["alignopsd_C"] == {"algorithm.estimator": "alignopsd", "algorithm.ablation": "C"}
    assert set(data["summary"]["cases"]["alignopsd_C"]) >= {"mass_moved_vs_full", "param_step", "probe_dlogp_abs"}


def _guess_bank(root):
    (root / "guess").mkdir(parents=True)
    (root / "guess" / "general.md").write_text("GENERAL: play the game.")
    (root / "guess" / "even.md").write_text("EVEN-RULE: the code word.")
    mapping = {"skill_files": {"general_skills": "general.md", "even": "even.md"}, "task_to_skill": {"even": "even"}}
    (root / "guess" / "skill_mapping.json").write_text(json.dumps(mapping))
    return root


def test_withheld_skill_control_from_the_cli(tmp_path, capsys):
    lh.register_guess_env()
    bank = _guess_bank(tmp_path / "bank")
    out = tmp_path / "ablate.json"
    sets = [a for o in [*GUESS, f"output_dir={tmp_path}", f"env.skills_dir={bank}"] for a in ("--set", o)]
    rc = cli.main(["ablate", "--config", TINY, *sets, "--estimators", "alignopsd_A", "--batches", "1",
                   "--withhold-skill", "2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    assert "control: the skill withheld from the teacher prompts of the last 2 siblings" in capsys.readouterr().out
    assert json.loads(out.read_text())["withheld_siblings"] == 2
    rc = cli.main(["ablate", "--config", TINY, *sets, "--batches", "1", "--withhold-skill", "4"])  # G = 4
    assert rc == 2 and "leaves none whose teacher knows the skill" in capsys.readouterr().err


def test_withheld_skill_needs_a_skill_bank(tmp_path):
    with pytest.raises(ValueError, match="env 'guess' has no skill bank"):
        paired_updates(_cases(tmp_path), batches=1, withheld_siblings=1)
    with pytest.raises(ValueError, match="withheld_siblings: expected an integer >= 0"):
        paired_updates(_cases(tmp_path), batches=1, withheld_siblings=-1)


@pytest.mark.slow
def test_decisive_states_are_the_probes_where_the_environment_reports_them(tmp_path):
    torch.set_num_threads(1)
    ov = ["env.name=credit", "env.max_turns=8", "generation.backend=choice", f"output_dir={tmp_path}"]
    cases = [AblationCase(n, load_config(TINY, [*ov, *o])) for n, o in (("grpo", GRPO), ("alignopsd", FULL))]
    res = paired_updates(cases, batches=1)
    b = res["per_batch"][0]
    assert b["probe_kind"] == "decisive" and b["probe_states"] > 0 and b["tasks"] == 2  # no task held out


# ---------------------------------------------------------------------------------------------------------------------
# the cases and their checks


def test_cases_table_is_the_benchmarks():
    from bench.credit import CASES

    assert CASES == {k: list(v) for k, v in ESTIMATOR_CASES.items()}
    assert case_overrides("alignopsd_B") == ["algorithm.estimator=alignopsd", "algorithm.ablation=B"]
    assert case_overrides("alignopsd") == FULL and "alignopsd" in case_names()
    with pytest.raises(ValueError, match="unknown 'bogus'; known: grpo"):
        case_overrides("bogus")
    assert case_list("alignopsd_A") == ["grpo", "alignopsd_A", "alignopsd"]
    assert case_list("alignopsd,grpo") == ["alignopsd", "grpo"]


def test_check_cases_refuses_what_would_not_pair(tmp_path):
    grpo, _, full = _cases(tmp_path)
    assert check_cases([grpo, full]) == (grpo, full)
    with pytest.raises(ValueError, match="grpo given twice"):
        check_cases([grpo, grpo, full])
    with pytest.raises(ValueError, match="needs GRPO"):
        check_cases([full])
    (lr,) = _cases(tmp_path, ["trainer.optimizer.lr=0.5"], (("fast", GRPO),))
    with pytest.raises(ValueError, match="fast's config differs from alignopsd's in trainer.optimizer.lr"):
        check_cases([lr, full])
    # Mechanism 2's settings are read only by the estimator: a case may differ in them (γH is M1's: refused)
    (tc,) = _cases(tmp_path, ["algorithm.credit.credit_temperature=0.1"], (("cold", FULL),))
    assert check_cases([grpo, full, tc]) == (grpo, full)
    assert case_settings([grpo, full, tc], full)["cold"] == {**dict(zip(CASE_KEYS, ("alignopsd", "E"))),
                                                             "algorithm.credit.credit_temperature": 0.1}  # fmt: skip
    assert case_settings([grpo, full, tc], full)["grpo"] == {"algorithm.estimator": "grpo", "algorithm.ablation": "E"}
    (g,) = _cases(tmp_path, ["algorithm.rectify.gamma=0.9"], (("strict", FULL),))
    with pytest.raises(ValueError, match="strict's config differs from alignopsd's in algorithm.rectify.gamma"):
        check_cases([grpo, full, g])
    assert cli.main(["ablate", "--config", TINY, "--estimators", "grpo,bogus"]) == 2


# ---------------------------------------------------------------------------------------------------------------------
# the measures


def test_mass_moved_and_weights_on_hand_values():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    A, r = torch.tensor([1.0, -0.5, 0.0]), torch.tensor([0.0, 0.1, 0.2])
    grpo = ((A + r)[:, None] * mask).double()
    assert mass_moved(grpo, grpo, mask) == 0.0
    w = torch.tensor([2.0, 0.5, 1.0])
    other = ((A * w + r)[:, None] * mask).double()
    # |1·2 − 1|·2 tokens + |−0.5·0.5 + 0.5|·1 over |1|·2 + |−0.4|·1 + |0.2|·3
    assert mass_moved(other, grpo, mask) == pytest.approx((2 * 1.0 + 0.25) / (2 + 0.4 + 0.6))
    assert math.isnan(mass_moved(other, torch.zeros(3, 3), mask))
    wg, wo = turn_weights(grpo, mask, A, r), turn_weights(other, mask, A, r)
    assert wg[:2].tolist() == pytest.approx([1.0, 1.0]) and wo[:2].tolist() == pytest.approx([2.0, 0.5])
    assert math.isnan(wg[2]) and math.isnan(wo[2])  # A = 0: no weight
    assert weight_divergence(wo, wg) == pytest.approx((1.0 + 0.5) / 2)


def test_groups_signs_and_probe_change():
    task, roll = torch.tensor([0, 0, 0, 1, 1, 2, 2]), torch.tensor([0, 0, 1, 0, 1, 0, 1])
    outcome = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    assert outcome_groups(task, roll, outcome) == (2, 1)
    assert toward_better(task, roll, outcome).tolist() == [1, 1, -1, 0, 0, 1, -1]
    before = torch.zeros(3, 2)
    after = torch.tensor([[0.5, 0.5], [-1.0, 9.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    abs_mean, toward = probe_change(before, after, mask, torch.tensor([1.0, -1.0, 0.0]))
    assert abs_mean == pytest.approx((1 + 1 + 2) / 3) and toward == pytest.approx((1 + 1) / 2)
    assert all(math.isnan(x) for x in probe_change(before[:0], after[:0], mask[:0], torch.zeros(0)))


def _batch(tasks: int, sibs: int, turns: int, truth=None) -> TurnBatch:
    idx = [(t, k, u) for t in range(tasks) for k in range(sibs) for u in range(turns)]
    m = len(idx)
    return TurnBatch(
        task=torch.tensor([i[0] for i in idx]),
        rollout=torch.tensor([i[1] for i in idx]),
        turn=torch.tensor([i[2] for i in idx]),
        prompt_ids=torch.ones(m, 2, dtype=torch.long),
        prompt_mask=torch.ones(m, 2, dtype=torch.long),
        response_ids=torch.ones(m, 2, dtype=torch.long),
        response_mask=torch.ones(m, 2, dtype=torch.long),
        outcome=torch.tensor([float(i[1] == 0) for i in idx]),
        action_valid=torch.ones(m, dtype=torch.bool),
        truth=[truth(*i) for i in idx] if truth else [],
    )


def test_probe_states_held_out_tasks_episodes_and_decisive():
    b = _batch(4, 3, 2)
    upd, probes_of = probe_states(b, None)
    p = probes_of(None)
    assert sorted(set(upd.task.tolist())) == [0, 1, 2] and p.kind == "held-out" and set(p.cb.task.tolist()) == {3}
    assert p.cb.size == 3 * 2 and p.sign.tolist() == [1, 1, -1, -1, -1, -1]
    upd, probes_of = probe_states(b, 2)
    assert sorted(set(upd.task.tolist())) == [0, 1]
    with pytest.raises(ValueError, match="holdout_tasks: 4 of the batch's 4 tasks"):
        probe_states(b, 4)
    one = _batch(1, 3, 2)  # one task: its last episode is held out, signed against all its siblings
    upd, probes_of = probe_states(one, None)
    p = probes_of(None)
    assert set(upd.rollout.tolist()) == {0, 1} and set(p.cb.rollout.tolist()) == {2}
    assert p.sign.tolist() == [-1, -1]
    with pytest.raises(ValueError, match="needs 3 or more"):
        probe_states(_batch(1, 2, 2), None)


def test_probe_states_decisive():
    from alignopsd.engine.step.recipe import ScoredBatch

    b = _batch(2, 2, 3, truth=lambda t, k, u: {"decisive": u == 1})
    upd, probes_of = probe_states(b, None)
    assert upd.size == b.size  # nothing held out
    p = probes_of(ScoredBatch(b, torch.ones(b.size), torch.zeros(b.size, 2), None, None))
    assert p.kind == "decisive" and p.cb.turn.tolist() == [1, 1, 1, 1] and p.sign.tolist() == [1, -1, 1, -1]


def test_t_interval():
    assert t_quantile_95(1) == 12.706 and t_quantile_95(30) == 2.042
    assert t_quantile_95(40) == pytest.approx(2.021075, abs=1e-5)  # Cornish-Fisher beyond the table
    assert t_quantile_95(1000) == pytest.approx(1.962339, abs=1e-5)
    with pytest.raises(ValueError, match="df"):
        t_quantile_95(0)
    m, h, n = mean_ci([1.0, 2.0, 3.0, float("nan"), None])
    assert (m, n) == (2.0, 3) and h == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(mean_ci([5.0])[1]) and mean_ci([])[2] == 0

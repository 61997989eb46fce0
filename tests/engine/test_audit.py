"""Audit records (ALGORITHM.md §4.3, engine/observe/audit.py): fields, snapshot schedule and selection, determinism,
size cap, write failures, off-turn match weight, and training identical with the audit on and off."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.observe.audit import (
    Auditor,
    audit_file,
    identity_hash,
    is_snapshot_step,
    select_snapshot,
    snapshot_records,
    turn_records,
)
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.teacher_pass import M1Result
from test_train import GUESS, TINY

from bench.credit_metrics import read_audit


def off_turn_match_weight_from_records(records: Iterable[dict]) -> float:
    """Σ_t Σ_j ω_j · 1[turn(s_j) ≠ turn(t)] / #matched targets over the ``turn`` records given (ALGORITHM.md §4.3),
    recomputed from the audit's records: the oracle of the logged ``m1/off_turn_match_weight``.

    Pass the records of one step (any number of ranks): a source's turn is looked up by its canonical
    index among the records of the same (step, rank). A target is matched when it has a source. 0 when
    nothing is matched; records without ``m1`` are ignored.
    """
    turns = [r for r in records if r.get("kind") == "turn" and r.get("m1") is not None]
    turn_of = {(r["step"], r["rank"], r["canonical_index"]): r["turn"] for r in turns}
    total, matched = 0.0, 0
    for r in turns:
        srcs = r["m1"].get("sources") or []
        if not srcs:
            continue
        matched += 1
        for s in srcs:
            st = turn_of.get((r["step"], r["rank"], s["index"]), s.get("turn"))
            if st != r["turn"]:
                total += float(s["omega"])
    return total / matched if matched else 0.0


STEPS = 3
BASE = [*GUESS, "algorithm.estimator=alignopsd", f"trainer.total_steps={STEPS}", "trainer.ppo.skip_no_signal=false"]


def _fit(out, extra=()):
    torch.set_num_threads(1)
    tr = lh.build_trainer(TINY, [*BASE, f"output_dir={out}", *extra])
    tr.fit()
    assert all(lh.no_region_errors(r) for r in read_metrics(out / "metrics.jsonl"))
    state = {k: v.detach().clone() for k, v in tr.parts.policy.model.state_dict().items()}
    rng = (torch.random.get_rng_state(), random.getstate())
    return {"out": out, "metrics": read_metrics(out / "metrics.jsonl"), "weights": state, "rng": rng}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same seeded 3-step AlignOPSD run three times: audit on, audit on again, audit off."""
    return {
        name: _fit(tmp_path_factory.mktemp(name), extra)
        for name, extra in (("on", ()), ("again", ()), ("off", ("trainer.logging.audit=false",)))
    }


def _files(out):
    return sorted(p.name for p in (out / "audit").glob("*.jsonl"))


# -- a tiny run --------------------------------------------------------------------------------------------------------


def test_records_have_the_fields(runs):
    out = runs["on"]["out"]
    assert _files(out) == [audit_file(out, s, 0).name for s in range(1, STEPS + 1)]
    metrics = runs["on"]["metrics"]
    for step in range(1, STEPS + 1):
        recs = read_audit(out / "audit", step)
        head, turns = recs[0], [r for r in recs if r["kind"] == "turn"]
        assert head["kind"] == "step" and head["step"] == step and head["estimator"] == "alignopsd"
        assert not head["skipped"] and head["turns"] == len(turns) > 0 and head["regions_found"]
        assert [r["canonical_index"] for r in turns] == list(range(len(turns)))
        ids = [(r["task"], r["rollout"], r["turn"]) for r in turns]
        assert len(set(ids)) == len(ids)
        for r in turns:
            reg = r["regions"]
            assert set(reg) == {"response", "thinking", "action", "other"}
            assert reg["response"]["tokens"] == sum(reg[k]["tokens"] for k in ("thinking", "action", "other")) > 0
            assert reg["thinking"]["tokens"] > 0 and reg["action"]["tokens"] > 0
            for k in (
                "sum_old_logp",
                "sum_advantage",
                "sum_diag_gap",
                "sum_cross_gap",
                "sum_corrected_gap",
                "neg_to_pos",
                "pos_to_neg",
            ):
                assert k in reg["response"]
            m1, m2 = r["m1"], r["m2"]
            assert m1["matched"] == bool(m1["sources"])
            for s in m1["sources"]:
                src = turns[s["index"]]
                assert (src["task"], src["rollout"], src["turn"]) == (s["task"], s["rollout"], s["turn"])
                assert s["task"] == r["task"] and s["rollout"] != r["rollout"] and s["H"] >= head["gamma"]
            if m1["sources"]:
                assert sum(s["omega"] for s in m1["sources"]) == pytest.approx(1.0, abs=1e-5)
            for k in (
                "span",
                "span_start",
                "span_end",
                "span_boundary",
                "boundary_kind",
                "turn_weight",
                "advantage",
                "turn_gap",
                "score",
                "raw_density",
                "density",
                "residual",
                "profile_valid",
            ):
                assert k in m2, k
            assert m2["span_start"] <= r["turn"] < m2["span_end"]
            expect = (
                m2["advantage"] * m2["turn_weight"] * reg["response"]["tokens"]
                + m2["residual"] * reg["response"]["tokens"]
            )
            assert reg["response"]["sum_advantage"] == pytest.approx(expect, rel=1e-4, abs=1e-4)
            assert reg["response"]["sum_abs_advantage"] == pytest.approx(abs(expect), rel=1e-4, abs=1e-4)
        # the §4.3 off-turn match weight from the records equals the logged one
        m = metrics[step - 1]
        assert off_turn_match_weight_from_records(recs) == pytest.approx(m["m1/off_turn_match_weight"], abs=1e-5)
        assert m["audit/capped"] == 0 and m["audit/error_count"] == 0 and m["audit/record_count"] == len(recs)


def test_snapshot_schedule_and_tokens(runs):
    assert [s for s in range(1, 26) if is_snapshot_step(s, 25)] == [1, 10, 20, 25]
    assert [s for s in range(1, 4) if is_snapshot_step(s, 3)] == [1, 3]
    out = runs["on"]["out"]
    for step in range(1, STEPS + 1):
        recs = read_audit(out / "audit", step)
        snaps = [r for r in recs if r["kind"] == "snapshot"]
        assert recs[0]["snapshot"] == (step != 2) == bool(snaps)
        if not snaps:
            continue
        turns = {r["canonical_index"]: r for r in recs if r["kind"] == "turn"}
        assert len(snaps) == min(8, len(turns)) and len({s["canonical_index"] for s in snaps}) == len(snaps)
        hashed = sorted(
            turns, key=lambda i: identity_hash(step, turns[i]["task"], turns[i]["rollout"], turns[i]["turn"])
        )[:4]
        assert [s["canonical_index"] for s in snaps[:4]] == hashed and all(s["reason"] == "hash" for s in snaps[:4])
        for s in snaps:
            t = turns[s["canonical_index"]]
            assert s["sources"] == [x["index"] for x in t["m1"]["sources"]]
            assert len(s["tokens"]) == t["regions"]["response"]["tokens"]
            tok = s["tokens"][0]
            for k in (
                "pos",
                "id",
                "piece",
                "region",
                "student",
                "teacher_diag",
                "teacher_cross",
                "teacher_rectified",
                "evidence",
                "advantage",
            ):
                assert k in tok, k
            assert all(len(x.get("teacher_sources", [])) == len(s["sources"]) for x in s["tokens"])
            adv = sum(x["advantage"] for x in s["tokens"])
            assert adv == pytest.approx(t["regions"]["response"]["sum_advantage"], rel=1e-4, abs=1e-4)
            if s["reason"] == "fallback":
                assert not t["m1"]["matched"]


def test_records_are_deterministic(runs):
    a, b = runs["on"]["out"] / "audit", runs["again"]["out"] / "audit"
    assert _files(runs["on"]["out"]) == _files(runs["again"]["out"])
    for name in _files(runs["on"]["out"]):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_training_identical_with_audit_on_and_off(runs):
    on, off = runs["on"], runs["off"]
    assert not (off["out"] / "audit").exists()
    skip = ("time/", "audit/", "memory/")  # measured, not computed
    for ra, rb in zip(on["metrics"], off["metrics"], strict=True):
        keys = {k for k in ra if not k.startswith(skip) and "per_s" not in k and k != "wall_time"}
        assert keys == {k for k in rb if not k.startswith(skip) and "per_s" not in k and k != "wall_time"}
        for k in keys:
            assert ra[k] == rb[k], (ra["step"], k)
    assert all(torch.equal(on["weights"][k], off["weights"][k]) for k in on["weights"])
    assert torch.equal(on["rng"][0], off["rng"][0]) and on["rng"][1] == off["rng"][1]  # no training RNG drawn


def test_unwritable_audit_dir_does_not_stop_training(tmp_path, runs, monkeypatch):
    """Outside strict mode an audit failure is counted and training goes on; in strict mode (the suite's) it raises."""
    from alignopsd.engine.observe.strict import STRICT_ENV

    (tmp_path / "audit").write_text("a file where the audit directory should be")
    with pytest.raises(OSError):
        _fit(tmp_path, ["trainer.total_steps=1"])
    monkeypatch.delenv(STRICT_ENV)
    got = _fit(tmp_path, ["trainer.total_steps=1"])["metrics"]
    assert [r["step"] for r in got] == [1]
    assert got[0]["audit/error_count"] == 1 and got[0]["audit/record_count"] == 0
    assert got[0]["actor/loss"] == runs["on"]["metrics"][0]["actor/loss"]


def test_tiny_cap_stops_writing(tmp_path, runs, caplog):
    """A cap that holds step 1 but not step 2: step 1 written as usual, then nothing; logged once, in the metrics."""
    first = audit_file(runs["on"]["out"] / "audit", 1, 0)
    cap = first.stat().st_size + 100
    with caplog.at_level(logging.WARNING, logger="alignopsd.audit"):
        got = _fit(tmp_path, ["trainer.total_steps=2", f"trainer.logging.audit_max_bytes={cap}"])["metrics"]
    assert _files(tmp_path) == [first.name] and audit_file(tmp_path / "audit", 1, 0).read_bytes() == first.read_bytes()
    assert [r["audit/capped"] for r in got] == [0.0, 1.0] and got[1]["audit/record_count"] == 0
    assert sum("size cap" in r.getMessage() for r in caplog.records) == 1
    assert [r["actor/loss"] for r in got] == [r["actor/loss"] for r in runs["on"]["metrics"][:2]]


# -- the writer and the selection on their own -----------------------------------------------------------------------


def test_size_cap(tmp_path, caplog):
    rec = [{"kind": "turn", "x": "y" * 100}]
    size = len(json.dumps(rec[0], separators=(",", ":")).encode()) + 1
    au = Auditor(tmp_path, total_steps=10, max_bytes=3 * size)
    with caplog.at_level(logging.WARNING, logger="alignopsd.audit"):
        assert au.write(1, rec) == 1 and au.write(2, rec * 2) == 1 * 2
        assert not au.capped and au.bytes == 3 * size
        assert au.write(1, rec) == 1  # rewriting a step's file counts its new size only
        assert au.write(3, rec) == 0 and au.capped
        assert au.write(4, []) == 0  # stays capped: nothing more is written
    assert sum("size cap" in r.getMessage() for r in caplog.records) == 1
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == [
        "step_000001.rank0.jsonl",
        "step_000002.rank0.jsonl",
    ]
    assert au.metrics()["audit/capped"] == 1.0
    # a writer counts the files of its rank it finds (the trainer has set later steps aside: engine/run/history.py)
    assert Auditor(tmp_path, total_steps=10, max_bytes=4 * size).bytes == 3 * size
    assert Auditor(tmp_path, total_steps=10, max_bytes=2 * size).capped  # already past this budget
    assert Auditor(tmp_path, total_steps=10, rank=1).bytes == 0  # another rank's files are not its own
    assert Auditor(tmp_path, total_steps=10, max_bytes=4 * size, world_size=2, rank=1).max_bytes == 2 * size


def _synthetic(seed=0):
    """2 tasks x 2 rollouts x 3 turns with M1 and M2 results of the core on random evidence."""
    from alignopsd.credit import allocate_credit
    from alignopsd.rectification import eligibility, pairs_from_selection, rectify, select_sources

    g = torch.Generator().manual_seed(seed)
    task = torch.tensor([0] * 6 + [1] * 6)
    roll = torch.tensor([0, 0, 0, 1, 1, 1] * 2)
    turn = torch.tensor([0, 1, 2] * 4)
    m, L = 12, 5
    mask = torch.ones(m, L, dtype=torch.long)
    mask[::2, -1] = 0
    cb = TurnBatch(
        task=task,
        rollout=roll,
        turn=turn,
        prompt_ids=torch.ones(m, 2, dtype=torch.long),
        prompt_mask=torch.ones(m, 2, dtype=torch.long),
        response_ids=torch.randint(3, 100, (m, L), generator=g),
        response_mask=mask,
        outcome=torch.tensor([1.0] * 3 + [0.0] * 3 + [0.0] * 3 + [1.0] * 3),
        action_valid=torch.ones(m, dtype=torch.bool),
    )
    H = torch.rand(m, m, generator=g) * (task[:, None] == task[None, :])
    valid = torch.ones(m, dtype=torch.bool)
    valid[5] = False  # turn 5 has invalid thinking: no source and never a source
    B = eligibility(task, roll, valid, valid)
    pairs = pairs_from_selection(select_sources(H, B, task, roll, turn, gamma=0.3, top_k=2))
    old = -torch.rand(m, L, generator=g) * 3
    diag = old + torch.randn(m, L, generator=g)
    cross = old[pairs[:, 1]] + torch.randn(pairs.shape[0], L, generator=g)
    rect = rectify(diag, cross, pairs, H, gamma=0.3, alpha_max=0.8)
    credit = allocate_credit(rect.corrected - old, mask, cb.outcome, task, roll, turn, H, B)
    return cb, old, diag, cross, H, B, rect, credit


def test_turn_records_and_selection_without_a_run():
    cb, old, diag, cross, H, B, rect, credit = _synthetic()
    counts = torch.ones(cb.size, dtype=torch.long)
    adv = credit.token_advantage
    before = [t.clone() for t in (old, diag, cross, H, adv)]
    m1 = M1Result(H=H, eligible=B, diag=diag, cross=cross)
    recs, scores = turn_records(5, 0, cb, counts, old, adv, rect=rect, m1=m1, credit=credit)
    assert all(torch.equal(a, b) for a, b in zip(before, (old, diag, cross, H, adv)))  # read, never written
    from alignopsd.diagnostics import off_turn_match_weight

    expect = off_turn_match_weight(rect.pairs, rect.pair_weight, cb.turn)
    assert off_turn_match_weight_from_records(recs) == pytest.approx(expect, abs=1e-6)
    assert not recs[5]["m1"]["matched"] and recs[5]["m1"]["eligible_sources"] == 0
    assert all(s["index"] != 5 for r in recs for s in r["m1"]["sources"])
    chosen = select_snapshot(5, cb, scores)
    assert chosen == select_snapshot(5, cb, scores) and len(chosen) == 8
    reasons = dict((r, i) for i, r in chosen)
    assert reasons["fallback"] == 5  # the only target without a source
    snaps = snapshot_records(5, 0, cb, chosen, old, adv, None, rect=rect, m1=m1)
    for s, (i, _) in zip(snaps, chosen):
        assert [t["pos"] for t in s["tokens"]] == torch.nonzero(cb.response_mask[i]).flatten().tolist()
        rows = [j for j, (_, t) in enumerate(rect.pairs.tolist()) if t == i]
        for t in s["tokens"]:
            assert t["teacher_sources"] == [pytest.approx(float(cross[j, t["pos"]]), rel=1e-6) for j in rows]
    # estimators without M1/M2 (GRPO): identity, regions, no m1/m2 fields, hash-only snapshots
    recs, scores = turn_records(5, 0, cb, counts, old, adv)
    assert "m1" not in recs[0] and "m2" not in recs[0] and set(recs[0]["regions"]) == {"response"}
    assert [r for _, r in select_snapshot(5, cb, scores)] == ["hash"] * 4 + ["hash_fill"] * 4


def test_targeted_choice_and_ties():
    cb, *_ = _synthetic()
    m = cb.size
    by_hash = sorted(range(m), key=lambda i: identity_hash(7, int(cb.task[i]), int(cb.rollout[i]), int(cb.turn[i])))
    outside = by_hash[4:]
    n2p = torch.zeros(m)
    n2p[outside[0]] = 1.0
    n2p[outside[1]] = 3.0
    p2n = torch.zeros(m)
    p2n[outside[1]] = 5.0  # already taken by neg_to_pos: the next best is chosen
    p2n[outside[2]] = 2.0
    p2n[outside[3]] = 2.0  # tie with outside[2]: hash order decides
    shift = torch.zeros(m)
    fb = torch.zeros(m)
    got = select_snapshot(7, cb, {"neg_to_pos": n2p, "pos_to_neg": p2n, "fallback": fb, "max_cross_shift": shift})
    assert got[:4] == [(i, "hash") for i in by_hash[:4]]
    assert got[4:6] == [(outside[1], "neg_to_pos"), (outside[2], "pos_to_neg")]
    assert got[6:] == [(outside[0], "hash_fill"), (outside[3], "hash_fill")]


def test_off_turn_match_weight_hand_case():
    """Targets 0 (turn 0) and 1 (turn 1) matched, target 2 not: ((0.6 off + 0.4 on) + (1.0 on)) / 2 = 0.3."""

    def rec(i, turn, sources):
        return {"kind": "turn", "step": 1, "rank": 0, "canonical_index": i, "turn": turn, "m1": {"sources": sources}}

    recs = [
        rec(0, 0, [{"index": 3, "omega": 0.6}, {"index": 4, "omega": 0.4}]),
        rec(1, 1, [{"index": 3, "omega": 1.0}]),
        rec(2, 2, []),
        rec(3, 1, []),
        rec(4, 0, []),
    ]
    assert off_turn_match_weight_from_records(recs) == pytest.approx(0.3)
    assert off_turn_match_weight_from_records(recs[2:]) == 0.0


def test_config_switch_is_validated():
    cfg = load_config(TINY, [])
    assert cfg.trainer.logging.audit is True and cfg.trainer.logging.audit_max_bytes == 1 << 30
    assert (
        load_config(TINY, ["trainer.logging.audit=false", "trainer.logging.audit_max_bytes=4096"]).trainer.logging.audit
        is False
    )
    for bad in (
        "trainer.logging.audit=maybe",
        "trainer.logging.audit_max_bytes=0",
        "trainer.logging.audit_max_bytes=1.5",
    ):
        with pytest.raises(ConfigError, match="trainer.logging.audit"):
            load_config(TINY, [bad])


def test_odd_truth_values_are_written_as_null_and_counted(tmp_path):
    """An environment's truth with NaN, infinity or values JSON has no form for: the step's records are all written
    (before, the whole step's file was lost), those values as null, each record saying how many it lost, and
    ``audit/truth_nulled_count`` counts them (summed over ranks, as declared)."""
    import dataclasses
    from types import SimpleNamespace

    import numpy as np
    from alignopsd.engine.parallel.collectives import reduce_metrics

    cb, old, diag, cross, H, B, rect, credit = _synthetic()
    truth = [None] * cb.size
    truth[1] = {"decisive": True, "score": float("nan"), "gap": [1.5, float("inf"), -float("inf")]}
    truth[4] = {"ids": {3, 4}, "raw": b"x", "n": np.int64(7), "ok": np.bool_(True), "x": np.float32(0.5), 2: "two"}
    truth[7] = {"phase": "open", "distance": 2}
    cb = dataclasses.replace(cb, truth=truth)
    counts = torch.ones(cb.size, dtype=torch.long)
    est = SimpleNamespace(rectified=rect, credit=credit)
    m1 = M1Result(H=H, eligible=B, diag=diag, cross=cross)
    au = Auditor(tmp_path, total_steps=10)
    metrics = au.record(2, cb, counts, old, credit.token_advantage, est, m1)
    recs = read_audit(tmp_path / "audit", 2)
    turns = [r for r in recs if r["kind"] == "turn"]
    assert len(turns) == cb.size and metrics["audit/record_count"] == len(recs) and metrics["audit/error_count"] == 0
    assert turns[1]["truth"] == {"decisive": True, "score": None, "gap": [1.5, None, None]}
    assert turns[1]["truth_nulled"] == 3
    assert turns[4]["truth"] == {"ids": None, "raw": None, "n": 7, "ok": True, "x": 0.5, "2": "two"}
    assert turns[4]["truth_nulled"] == 2
    assert turns[7]["truth"] == {"phase": "open", "distance": 2} and "truth_nulled" not in turns[7]
    assert "truth" not in turns[0] and all("m1" in t and "m2" in t for t in turns)  # the rest as always
    assert metrics["audit/truth_nulled_count"] == 5
    other = Auditor(tmp_path / "rank1", total_steps=10, rank=1, world_size=2).metrics(truth_nulled=2)
    assert reduce_metrics([metrics, other], strict=True)["audit/truth_nulled_count"] == 7

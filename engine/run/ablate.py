"""Paired counterfactual updates (``alignopsd ablate``): which mechanism moves the update.

From one starting point (a checkpoint, or the config's model) the run draws ``batches`` rollout batches, batch b with
the tasks and sampling seed of training step ``start + b`` (the engine's own rollout, engine/step/recipe.py
``rollout_batch``), and scores each once: old and reference log-probs and the teacher pass that the cases need
(``score_batch``). Then every estimator case updates the policy from the same state: before each update the
policy's weights and optimizer state and the generators' states go back to the snapshot taken before the first
(engine/run/snapshot.py, through the policy backend's checkpoint methods), and the restored weights' hash is
recorded. The measures of one update against the full method (AlignOPSD, ablation E) and against GRPO are those of
engine/run/ablate_measures.py.

Probe states: where the environment reports ground truth with a ``decisive`` flag (its info's ``truth``, carried per
turn by the rows: the ``credit`` and ``credit_drift`` families), the decisive states of the batch; otherwise a
held-out slice of the batch (its last ``holdout_tasks`` tasks, default a quarter; in a batch of one task, as the
quickstart's, its last sibling episode), left out of the update and of the teacher pass.

A control (``withheld_siblings`` K > 0; not the paper's method): the teacher prompts of the last K siblings of every
task carry the general skill only (engine/envs/skills.py ``skill_withheld``), so the teacher's local grade of those
turns is uninformed and only a sibling's aligned turn (Mechanism 1) can inform it.

The cases differ in their estimator and ablation only (refused otherwise): the batch, its scoring and the update's
settings are the same for all. On a CPU the rows of every update are padded (no packed-rows timing trial, which
would run the first case's update both ways). One process: data and tensor parallelism are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from alignopsd.engine.checkpoint.trainer_state import RowsChoice
from alignopsd.engine.config.cases import BASELINE, FULL_METHOD
from alignopsd.engine.config.schema import RunConfig
from alignopsd.engine.envs.skills import load_skill_bank, skill_lookup, skill_withheld
from alignopsd.engine.infra.mappings import flatten_config
from alignopsd.engine.run.ablate_measures import (
    mass_moved,
    outcome_groups,
    parameter_step,
    probe_change,
    summarise,
    toward_better,
    turn_weights,
    weight_divergence,
)
from alignopsd.engine.run.resume import stored_config
from alignopsd.engine.run.snapshot import PolicySnapshot, trained_parameters, weight_hash
from alignopsd.engine.run.trainer import Trainer
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.components import Components
from alignopsd.engine.step.recipe import ScoredBatch, estimate, estimator_inputs, rollout_batch, score_batch
from alignopsd.engine.step.update import ppo_update

from alignopsd.canonical import canonicalize
from alignopsd.estimators import EstimatorPhases, get_estimator, outcome_advantage

__all__ = [
    "CASE_KEYS",
    "ESTIMATE_ONLY",
    "INTERVAL",
    "AblationCase",
    "case_settings",
    "check_cases",
    "paired_updates",
    "probe_states",
]

log = logging.getLogger("alignopsd.ablate")

CASE_KEYS = ("algorithm.estimator", "algorithm.ablation")
"""The settings that name a case's estimator."""

ESTIMATE_ONLY = ("algorithm.credit.",)
"""Settings read only where the estimator turns the scored batch into advantages (Mechanism 2's: T_c, η, spans,
bounds): cases may differ in them too (one batch and one scoring serve all), e.g. the full method at two T_c."""

INTERVAL = "95 % t-interval over batches (Student's t, n - 1 degrees of freedom)"


@dataclass(frozen=True)
class AblationCase:
    """One estimator case: its name (a row of the output) and its run config."""

    name: str
    cfg: RunConfig


def _is_full(cfg: RunConfig) -> bool:
    return cfg.algorithm.estimator == FULL_METHOD and cfg.algorithm.ablation == "E"


def check_cases(cases: Sequence[AblationCase]) -> tuple[AblationCase, AblationCase]:
    """(the GRPO case, the full method's case): the first of each; ValueError naming the culprit when a name repeats,
    either reference is missing, or two configs differ outside :data:`CASE_KEYS` and :data:`ESTIMATE_ONLY`."""
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"estimators: {', '.join(dup)} given twice")
    base = next((c for c in cases if c.cfg.algorithm.estimator == BASELINE), None)
    full = next((c for c in cases if _is_full(c.cfg)), None)
    if base is None or full is None:
        raise ValueError(
            f"estimators: the comparison needs GRPO ({BASELINE}) and the full method ({FULL_METHOD}, ablation E); "
            f"got {', '.join(names)}"
        )
    ref = flatten_config(stored_config(full.cfg))
    for c in cases:
        mine = flatten_config(stored_config(c.cfg))
        diff = sorted(k for k in _differences(ref, mine) if k not in CASE_KEYS and not k.startswith(ESTIMATE_ONLY))
        if diff:
            raise ValueError(
                f"estimators: {c.name}'s config differs from {full.name}'s in {', '.join(diff[:5])}; the cases may "
                f"differ only in {', '.join(CASE_KEYS)} and the settings under {', '.join(ESTIMATE_ONLY)}"
            )
    return base, full


def _differences(ref: dict, mine: dict) -> list[str]:
    return sorted(k for k in set(ref) | set(mine) if ref.get(k) != mine.get(k))


def case_settings(cases: Sequence[AblationCase], full: AblationCase) -> dict[str, dict]:
    """Per case, its :data:`CASE_KEYS` and the :data:`ESTIMATE_ONLY` settings where it differs from the full method."""
    ref = flatten_config(stored_config(full.cfg))
    out = {}
    for c in cases:
        mine = flatten_config(stored_config(c.cfg))
        own = [k for k in _differences(ref, mine) if k.startswith(ESTIMATE_ONLY)]
        out[c.name] = {k: mine[k] for k in (*CASE_KEYS, *own)}
    return out


@dataclass
class Probes:
    """The probe states of one batch: how chosen (``decisive`` or ``held-out``), their canonical rows and the sign of
    each one's episode outcome against its task's siblings' mean."""

    kind: str
    cb: TurnBatch
    sign: torch.Tensor


def _decisive(truth: object) -> bool | None:
    """The ``decisive`` flag of a row's ground truth, None where it reports none."""
    return bool(truth["decisive"]) if isinstance(truth, dict) and "decisive" in truth else None


def probe_states(batch: TurnBatch, holdout_tasks: int | None) -> tuple[TurnBatch, Callable[[ScoredBatch], Probes]]:
    """(the rows the update takes, a function of the scored update batch giving the probe states): the decisive
    states where the rows' ground truth flags them, else the canonical turns of a held-out slice the update leaves
    out: the last ``holdout_tasks`` tasks (default: a quarter of the batch's tasks, at least 1), or, in a batch of
    one task, its last sibling episode (the update keeps the other G - 1)."""
    if any(_decisive(t) is not None for t in batch.truth):

        def decisive(scored: ScoredBatch) -> Probes:
            cb = scored.cb
            keep = [i for i, t in enumerate(cb.truth) if _decisive(t)]
            sign = toward_better(cb.task, cb.rollout, cb.outcome)[keep]
            return Probes("decisive", cb.select(keep), sign)

        return batch, decisive
    task, roll = batch.task.tolist(), batch.rollout.tolist()
    tasks = sorted(set(task))
    if len(tasks) == 1 and holdout_tasks is None:  # one task: its last sibling episode is the held-out slice
        sibs = sorted(set(roll))
        if len(sibs) < 3:
            raise ValueError(
                f"env.group_n: the batch's one task has {len(sibs)} episodes; holding one out for the probe states "
                "needs 3 or more (or raise env.tasks_per_step to hold out tasks)"
            )
        held_row = [k == sibs[-1] for k in roll]
    else:
        k = max(1, len(tasks) // 4) if holdout_tasks is None else int(holdout_tasks)
        if not 1 <= k < len(tasks):
            raise ValueError(
                f"holdout_tasks: {k} of the batch's {len(tasks)} tasks leaves no task to update on or none to probe "
                "(this environment reports no decisive states, so the probes are held-out tasks)"
            )
        held = set(tasks[-k:])
        held_row = [t in held for t in task]
    rows = [i for i, h in enumerate(held_row) if not h]
    held_rows = [i for i, h in enumerate(held_row) if h]
    probe = batch.select(held_rows)
    canon = canonicalize(probe.task.tolist(), probe.rollout.tolist(), probe.turn.tolist())
    cb = probe.select(canon.first_row)
    # against every sibling of the batch (a held-out episode's siblings are in the update)
    sign = toward_better(batch.task, batch.rollout, batch.outcome)[held_rows][canon.first_row]
    return batch.select(rows), lambda _scored: Probes("held-out", cb, sign)


def _union_phases(parts: Components, cases: Sequence[AblationCase]) -> EstimatorPhases:
    """Every phase any case needs (the batch is scored once for all)."""
    ph = [get_estimator(c.cfg.algorithm.estimator).phases(c.cfg.algorithm) for c in cases]
    return EstimatorPhases(
        teacher_diag=any(p.teacher_diag for p in ph),
        alignment=any(p.alignment for p in ph),
        ref=any(p.ref for p in ph),
        mechanism2=False,
    )


def _pin_rows(parts: Components) -> None:
    """Padded rows for every update when nothing chose yet (see the module docstring)."""
    parts.policy.rows.choose(RowsChoice(False, why="alignopsd ablate: every case's update alike"))


def _case_update(parts: Components, case: AblationCase, scored: ScoredBatch, step: int) -> dict:
    """One case's update from the current policy: its token advantages (host), update metrics and parameter step."""
    spec = get_estimator(case.cfg.algorithm.estimator)
    mine = replace(parts, cfg=case.cfg, estimator=spec)
    phases = spec.phases(case.cfg.algorithm)
    before = [p.detach().to("cpu", copy=True) for _, p in trained_parameters(parts.policy)]
    out, _, _ = estimate(mine, scored.cb, scored.old_logp, scored.m1, step, phases, scored.counts)
    with parts.profiler.phase("update"):
        upd = ppo_update(mine, scored.cb, scored.old_logp, scored.ref_logp, out.token_advantage, out.aux)
    return {
        "adv": out.token_advantage.detach().to("cpu", torch.float64),
        "param_step": parameter_step(before, (p for _, p in trained_parameters(parts.policy))),
        "update_skipped": bool(upd.get("update/skipped", 0.0)),
        "end_hash": weight_hash(parts.policy),
    }


def _batch(
    parts: Components, cases: Sequence[AblationCase], full: AblationCase, base: AblationCase, step: int, holdout
) -> dict:
    """Roll out and score batch ``step``, apply every case's update from one snapshot, measure (one batch's record)."""
    phases = _union_phases(parts, cases)
    parts.profiler.start_step()
    batch, _ = rollout_batch(parts, step, teacher_prompts=phases.alignment or phases.teacher_diag)
    update_rows, probes_of = probe_states(batch, holdout)
    scored, _ = score_batch(parts, update_rows, phases)
    probes = probes_of(scored)
    cb = scored.cb
    inputs = estimator_inputs(replace(parts, cfg=full.cfg), cb, scored.old_logp, scored.m1, step, scored.counts)
    A, r, _ = outcome_advantage(inputs, full.cfg.algorithm)
    with_signal, without = outcome_groups(cb.task, cb.rollout, cb.outcome)
    probe_before = parts.rescorer.student_logprobs(probes.cb)[0]
    snap = PolicySnapshot(parts.policy)
    runs: dict[str, dict] = {}
    try:
        for c in cases:
            start = snap.restore()
            runs[c.name] = {"start_hash": start, **_case_update(parts, c, scored, step)}
            after = parts.rescorer.student_logprobs(probes.cb)[0]
            runs[c.name]["probe"] = probe_change(probe_before, after, probes.cb.response_mask, probes.sign)
        snap.restore()  # the next batch starts from the same point
    finally:
        snap.close()
        parts.profiler.end_step()
    mask = cb.response_mask.bool().cpu()
    w = {n: turn_weights(x["adv"], mask, A.cpu(), r.cpu()) for n, x in runs.items()}
    out_cases = {}
    for n, x in runs.items():
        out_cases[n] = {
            "mass_moved_vs_full": mass_moved(x["adv"], runs[full.name]["adv"], mask),
            "mass_moved_vs_grpo": mass_moved(x["adv"], runs[base.name]["adv"], mask),
            "weight_divergence_vs_full": weight_divergence(w[n], w[full.name]),
            "weight_divergence_vs_grpo": weight_divergence(w[n], w[base.name]),
            "param_step": x["param_step"],
            "probe_dlogp_abs": x["probe"][0],
            "probe_dlogp_toward_better": x["probe"][1],
            "update_skipped": x["update_skipped"],
            "start_hash": x["start_hash"],
            "end_hash": x["end_hash"],
        }
    return {
        "step": step,
        "tasks": with_signal + without,
        "turns": cb.size,
        "groups_with_signal": with_signal,
        "groups_without_signal": without,
        "probe_kind": probes.kind,
        "probe_states": probes.cb.size,
        "cases": out_cases,
    }


def _withheld_lookup(cfg: RunConfig, lookup: Callable[[dict], str] | None, withheld: int) -> Callable[[dict], str]:
    """The run's skill lookup with the skill withheld from the last ``withheld`` siblings of every task."""
    bank = lookup if lookup is not None else skill_lookup(cfg.env.name)
    if bank is None:
        raise ValueError(f"withheld_siblings: env {cfg.env.name!r} has no skill bank, so there is no skill to withhold")
    if withheld >= cfg.env.group_n:
        raise ValueError(
            f"withheld_siblings: {withheld} of env.group_n = {cfg.env.group_n} siblings leaves none whose teacher "
            "knows the skill"
        )
    general = load_skill_bank(cfg.env.name, cfg.env.skills_dir).general
    return skill_withheld(bank, general, cfg.env.group_n, withheld)


def paired_updates(
    cases: Sequence[AblationCase],
    *,
    checkpoint: str | Path | None = None,
    batches: int = 1,
    holdout_tasks: int | None = None,
    withheld_siblings: int = 0,
    say: Callable[[str], None] = log.info,
) -> dict:
    """Every case's update on ``batches`` batches from one starting point (see the module docstring); returns the
    per-batch records and their summary (means and 95 % t-intervals over batches). ``withheld_siblings``: the
    control of the module docstring (0: none)."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches: expected an integer >= 1, got {batches!r}")
    if isinstance(withheld_siblings, bool) or not isinstance(withheld_siblings, int) or withheld_siblings < 0:
        raise ValueError(f"withheld_siblings: expected an integer >= 0, got {withheld_siblings!r}")
    if holdout_tasks is not None and (isinstance(holdout_tasks, bool) or int(holdout_tasks) < 1):
        raise ValueError(f"holdout_tasks: expected an integer >= 1, got {holdout_tasks!r}")
    base, full = check_cases(cases)
    trainer = Trainer(full.cfg, lock_output=False)  # reads and writes nothing of the run's folder
    parts = trainer.parts
    try:
        if trainer.world_size > 1 or parts.policy.layout.tp_size > 1:
            raise ValueError("alignopsd ablate runs in one process: start it without torchrun, at tensor parallel 1")
        if checkpoint is not None:
            trainer.load(Path(checkpoint))  # verified first; its weights, optimizer state and generators' states
        _pin_rows(parts)
        if withheld_siblings:
            parts = replace(parts, skill_lookup=_withheld_lookup(full.cfg, parts.skill_lookup, withheld_siblings))
        start = trainer.step
        records = []
        for b in range(batches):
            records.append(_batch(parts, cases, full, base, start + b, holdout_tasks))
            rec = records[-1]
            say(
                f"batch {b + 1}/{batches} (step {rec['step']}): {rec['tasks']} tasks, {rec['groups_with_signal']} "
                f"with outcome signal; {rec['probe_states']} {rec['probe_kind']} probe states"
            )
    finally:
        parts.close()
    names = [c.name for c in cases]
    return {
        "model": full.cfg.model.name,
        "env": full.cfg.env.name,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "start_step": start,
        "batches": batches,
        "withheld_siblings": withheld_siblings,
        "cases": case_settings(cases, full),
        "full": full.name,
        "grpo": base.name,
        "interval": INTERVAL,
        "per_batch": records,
        "summary": summarise(records, names),
    }

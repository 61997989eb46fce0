"""The rollout phase of a training step and of validation: which tasks, which sampling settings, which metrics.

Tasks are deterministic in (seed, step, rank), so the data position of a checkpoint is its step. The sampling
stops at the closing action tags (``generation.teacher.ACTION_STOPS``, defined once for every environment: each
parses the same three tags, §1.5).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import TYPE_CHECKING

from alignopsd.engine.generation.base import SamplingParams, prefill_counts, prefill_delta
from alignopsd.engine.generation.teacher import ACTION_STOPS
from alignopsd.engine.observe.profiler import StepProfiler
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.group_sampling import group_rollout
from alignopsd.engine.step.rollout import collect_rollouts

from alignopsd.reduction import extreme_max, summed, weighted_mean

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig


def tasks_for_step(tasks: list, step: int, n: int, seed: int, rank: int = 0, world_size: int = 1) -> list:
    """The ``n`` tasks of training step ``step`` (epoch-wise seeded permutation), this rank's share."""
    if not tasks:
        raise ValueError("tasks: the task source is empty")
    total = len(tasks)
    start = step * n
    out = []
    for k in range(start, start + n):
        epoch, pos = divmod(k, total)
        perm = list(range(total))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.append(tasks[perm[pos]])
    per = n // world_size
    return out[rank * per : (rank + 1) * per]


def step_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of (run seed, step, data-parallel rank)."""
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**31 - 1)


def sampling_params(cfg: RunConfig, validation: bool) -> SamplingParams:
    """The student's sampling settings (training or validation), stopping at the closing action tags."""
    g = cfg.generation
    return SamplingParams(
        max_new_tokens=g.max_response_length,
        temperature=g.val_temperature if validation else g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        do_sample=g.val_do_sample if validation else g.do_sample,
        stop=ACTION_STOPS,
    )


def rollout_phase(
    parts, tasks: list, *, seed: int, validation: bool, teacher_prompts: bool = False
) -> tuple[TurnBatch, dict[str, float]]:
    """Collect the turn batch of ``tasks`` (G siblings each, or 1 in validation) and its episode metrics.

    teacher_prompts: also build the privileged prompts (§1.4; estimators with a teacher pass, training only)."""
    cfg = parts.cfg
    prof = parts.profiler
    env_before = parts.env.metrics()
    per = cfg.env.tasks_per_step // parts.world_size
    prefill_before = prefill_counts(parts.generator)
    with prof.phase("rollout_generation"):
        batch = collect_rollouts(
            parts.env,
            parts.generator,
            parts.tokenizer,
            tasks,
            group_n=cfg.env.group_n,
            sampling=sampling_params(cfg, validation),
            max_prompt_length=cfg.env.max_prompt_length,
            max_turns=cfg.env.max_turns,
            seed=seed,
            validation=validation,
            teacher_prompts=teacher_prompts and not validation,
            student_skills=cfg.env.student_skills == "always" or (validation and cfg.env.student_skills != "off"),
            task_offset=parts.rank * per,
            skill_lookup=parts.skill_lookup,
        )
    rm = batch.extras.get("rollout_metrics", {})
    prof.move("rollout_generation", "environment", float(rm.get("environment_s", 0.0)))
    env_after = parts.env.metrics()
    metrics = episode_metrics(parts.env.episode_results(), batch)
    metrics.update(prefill_delta(prefill_before, prefill_counts(parts.generator), "rollout/"))
    for k in ("prompt_truncated", "teacher_prompt_truncated", "response_truncated", "empty_responses"):
        if k in rm:
            metrics[f"rollout/{k}"] = summed(rm[k])
    for k in ("generation_tokens_per_s", "prompt_length_mean"):  # per row of this rank's batch
        if k in rm:
            metrics[f"rollout/{k}"] = weighted_mean(rm[k], batch.size)
    for k in (
        "failed_episodes",
        "env_errors",
        "timeouts",
        "worker_deaths",
        "invalid_actions",
        "nonfinite_rewards",
        "timeout_waves",
        "redispatched_ops",
        "rebuilt_episodes",
        "worker_restarts",
    ):
        metrics[f"env/{k}"] = summed(env_after.get(k, 0) - env_before.get(k, 0))
    return batch, metrics


def run_validation(parts, step: int) -> dict[str, float]:
    """Validation pass on held-out tasks: group size 1, validation sampling, its own seeds; no update."""
    cfg = parts.cfg
    per = len(parts.val_tasks) // parts.world_size
    tasks = parts.val_tasks[parts.rank * per : (parts.rank + 1) * per] or parts.val_tasks[:1]
    parts = replace(parts, profiler=StepProfiler())  # its own phase times, apart from the training step's
    parts.profiler.start_step()
    seed = step_seed(cfg.trainer.seed, 10_000_000 + step, parts.rank)
    # once per tensor-parallel group, as in training (the group's other ranks receive its metrics)
    _, metrics = group_rollout(parts, lambda: rollout_phase(parts, tasks, seed=seed, validation=True))
    return metrics


def episode_metrics(results: list[dict], batch: TurnBatch | None) -> dict[str, float]:
    """Reward, success, per-category success, valid-action rate, response lengths of one batch of episodes; each
    rate and mean declared over its own population (a category's episodes, the scored episodes, the turns)."""
    out: dict[str, float] = {}
    n = len(results)
    out["episode/count"] = summed(n)
    if n:
        out["episode/reward_mean"] = weighted_mean(sum(r["reward"] for r in results) / n, n)
        out["episode/success_rate"] = weighted_mean(sum(bool(r["won"]) for r in results) / n, n)
        out["episode/turns_mean"] = weighted_mean(sum(r["steps"] for r in results) / n, n)
        out["episode/failed_count"] = summed(sum(bool(r.get("failed")) for r in results))
        scores = [r["task_score"] for r in results if r.get("task_score") is not None]
        if scores:
            out["episode/task_score_mean"] = weighted_mean(sum(float(s) for s in scores) / len(scores), len(scores))
        cats: dict[str, list[bool]] = {}
        for r in results:
            cats.setdefault(str(r.get("category") or "all"), []).append(bool(r["won"]))
        for c, wins in sorted(cats.items()):
            out[f"episode/success/{c}"] = weighted_mean(sum(wins) / len(wins), len(wins))
        srcs: dict[str, list[bool]] = {}
        for r in results:
            srcs.setdefault(str(r.get("data_source") or "text"), []).append(bool(r["won"]))
        if len(srcs) > 1 or "text" not in srcs:
            for s, wins in sorted(srcs.items()):
                out[f"episode/accuracy/{s}"] = weighted_mean(sum(wins) / len(wins), len(wins))
    if batch is not None and batch.size:
        rows = batch.size
        out["episode/valid_action_rate"] = weighted_mean(float(batch.action_valid.float().mean()), rows)
        lens = batch.response_mask.long().sum(1).float()
        out["rollout/response_length_mean"] = weighted_mean(float(lens.mean()), rows)
        out["rollout/response_length_max"] = extreme_max(float(lens.max()), rows)
        if batch.truncated is not None:
            out["rollout/truncated_rate"] = weighted_mean(float(batch.truncated.float().mean()), rows)
    return out

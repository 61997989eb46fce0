"""The work of one step of a config at full scale, for ``alignopsd plan`` (engine/commands/plan.py).

A config gives maxima (turn budget, prompt and response lengths, teacher budget); the means a step actually
pushes come from the quickstart's measurement (:data:`QUICKSTART_MEANS`, the warm-started quickstart's
AlignOPSD step as ``alignopsd profile`` counted it), applied as fractions of the quickstart's own maxima:
prompt, response, teacher prompt and teacher response lengths, turns per episode, the prefill positions left
after prefix sharing, the distinct teacher prompts and the cross rows per turn. :func:`plan_counts` returns the
per-generation-group :class:`StepCounts` of ``cfg`` at ``world_size`` devices and the assumptions it made, in
words, so the plan can print them.

Padding: the counts here are real positions; engine/lab/padding_plan.py ``planned_counts`` adds the share of
padded positions the config's forwards compute (the update's own planner over a synthetic batch) and is what the
plan and the estimate read.

:data:`NEMO_RL_REFERENCE` is a published GRPO measurement (NeMo-RL's performance summary: Llama-3.1-8B, on-policy,
16 x H100, 2,048 samples per step, training batch 512) with the counts the same model is evaluated at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from alignopsd.engine.lab.cost_model import StepCounts
from alignopsd.engine.parallel.split import check_split

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

# The quickstart (configs/quickstart_cpu.yaml from its 60-step warm start), AlignOPSD step, per step: measured means
# and the config's maxima they are read against (bench/results/overhead-2026-12-02-warm.md, last section: lengths,
# teacher prompts unshared 20,640 = 32 x 645; overhead-2026-12-02-cached.md, step 1: prefill positions 6,106 and
# 7,637, 20 distinct teacher prompts, ~1,050 teacher tokens).
QUICKSTART_MEANS = {
    "turns_mean": 8.0, "max_turns": 8,
    "prompt_mean": 400.0, "max_prompt_length": 1024,
    "response_mean": 41.0, "max_response_length": 64,
    "teacher_prompt_mean": 645.0,  # the privileged prompts (skills + task) over the same max_prompt_length
    "teacher_response_mean": 33.0, "teacher_budget": 64,
    "rollout_prefill_fraction": 6106 / 12800,  # prefill positions after sharing / rows x prompt mean
    "teacher_prefill_fraction": 7637 / 20640,  # teacher prefill positions after sharing / rows x teacher prompt
    "distinct_teacher_prompts": 20 / 32,  # distinct privileged prompts per canonical turn
    "cross_rows_per_turn": 2.0,  # teacher-forced rows besides the diagonal, per canonical turn
}  # fmt: skip


@dataclass(frozen=True)
class Layout:
    world_size: int
    tensor_parallel: int
    data_parallel: int


def layout(cfg: RunConfig, world_size: int) -> Layout:
    """Data-parallel groups of ``world_size`` devices under the config's tensor parallelism (ValueError naming the
    value and what is allowed)."""
    tp = int(cfg.policy.tensor_parallel_size)
    if world_size < 1 or world_size % tp:
        raise ValueError(
            f"--world-size: {world_size} does not divide into policy.tensor_parallel_size {tp}; "
            f"allowed: a positive multiple of {tp}"
        )
    dp = world_size // tp
    check_split(
        cfg.env.tasks_per_step,
        dp,
        key="env.tasks_per_step",
        items="tasks per step",
        groups_from=f"--world-size {world_size} / policy.tensor_parallel_size {tp}",
    )
    return Layout(world_size, tp, dp)


def group_rows(cfg: RunConfig, lay: Layout, means: dict | None = None) -> tuple[float, float, float]:
    """(turn rows, episodes, turns per episode) of one step per data-parallel group."""
    q = QUICKSTART_MEANS if means is None else means
    episodes = cfg.env.tasks_per_step * cfg.env.group_n / lay.data_parallel
    turns = cfg.env.max_turns * q["turns_mean"] / q["max_turns"]
    return episodes * turns, episodes, turns


def plan_counts(cfg: RunConfig, lay: Layout, means: dict | None = None) -> tuple[StepCounts, list[str]]:
    """Per-group step counts of ``cfg`` at layout ``lay`` (real positions, no padding), and the assumptions made
    (one line each)."""
    q = QUICKSTART_MEANS if means is None else means
    e, g = cfg.env, cfg.generation
    rows, episodes, turns = group_rows(cfg, lay, q)
    p = e.max_prompt_length * q["prompt_mean"] / q["max_prompt_length"]
    r = g.max_response_length * q["response_mean"] / q["max_response_length"]
    tp_len = min(e.max_prompt_length, e.max_prompt_length * q["teacher_prompt_mean"] / q["max_prompt_length"])
    t_resp = cfg.teacher_budget * q["teacher_response_mean"] / q["teacher_budget"]
    forcing_rows = rows * (1 + q["cross_rows_per_turn"])
    cached = g.backend == "hf"  # the Hugging Face generator keeps the teacher prompts' keys/values for the forcing
    prompt_pos = 0.0 if cached else rows * q["distinct_teacher_prompts"] * tp_len
    resp_pos = forcing_rows * r
    ctx = (prompt_pos * tp_len / 2 + resp_pos * (tp_len + r / 2)) / max(prompt_pos + resp_pos, 1.0)
    reference = float(cfg.algorithm.kl_coef) != 0.0
    c = StepCounts(
        rows=rows,
        rows_per_call=episodes,
        prompt_mean=p,
        response_mean=r,
        rollout_prefill=rows * p * q["rollout_prefill_fraction"],
        train_rows=rows,
        teacher_rows=rows,
        teacher_prompt_mean=tp_len,
        teacher_prefill=rows * tp_len * q["teacher_prefill_fraction"],
        teacher_tokens=rows * t_resp,
        forcing_rows=forcing_rows,
        forcing_positions=prompt_pos + resp_pos,
        forcing_context=ctx,
        reference=reference,
        optimizer_steps=math.ceil(rows * lay.data_parallel / cfg.trainer.ppo.mini_batch_size),
        recompute=bool(cfg.policy.gradient_checkpointing),
    )
    f = q
    notes = [
        f"per data-parallel group ({lay.data_parallel} groups of {lay.tensor_parallel} devices): {episodes:g} episodes "
        f"(env.tasks_per_step {e.tasks_per_step} x env.group_n {e.group_n} / {lay.data_parallel}), decoded together",
        f"turns per episode {turns:g} = env.max_turns {e.max_turns} x {f['turns_mean']:g}/{f['max_turns']} "
        "(quickstart mean / its max)",
        f"prompt mean {p:,.0f} = env.max_prompt_length x {f['prompt_mean']:g}/{f['max_prompt_length']}; response mean "
        f"{r:,.0f} = generation.max_response_length x {f['response_mean']:g}/{f['max_response_length']}",
        f"teacher prompt mean {tp_len:,.0f} (x {f['teacher_prompt_mean']:g}/{f['max_prompt_length']}), "
        f"teacher response mean {t_resp:,.0f} = teacher budget {cfg.teacher_budget} x "
        f"{f['teacher_response_mean']:g}/{f['teacher_budget']}",
        f"prefill after prefix sharing: rollout {f['rollout_prefill_fraction']:.2f}, teacher "
        f"{f['teacher_prefill_fraction']:.2f} of the unshared positions; cross rows per turn "
        f"{f['cross_rows_per_turn']:g}",
        (
            "teacher forcing reads the teacher generation's prompt keys/values (generation.backend hf)"
            if cached
            else f"teacher forcing scores the {f['distinct_teacher_prompts']:.2f} distinct teacher prompts per turn "
            f"again (generation.backend {g.backend}: the prompts' keys/values are not kept), then the responses"
        ),
        f"reference pass: {'yes' if reference else 'no'} (algorithm.kl_coef {cfg.algorithm.kl_coef}); "
        f"{c.optimizer_steps} optimizer steps (rows / trainer.ppo.mini_batch_size); gradient checkpointing "
        f"{'on (forward recomputed)' if c.recompute else 'off'}",
        "generation runs on one device per tensor-parallel group (it samples once and shares the batch); scoring "
        "and the update are split over the group",
    ]
    return c, notes


@dataclass(frozen=True)
class Reference:
    """A published measurement and the counts this model evaluates it at."""

    label: str
    model: str
    gpu: str
    world_size: int
    step_seconds: float
    tokens_per_s_gpu: float
    counts: StepCounts
    notes: tuple[str, ...]


def _nemo_reference() -> Reference:
    gpus, samples, prompts, step, tps = 16, 2048, 64, 92.8, 1581.0
    seq = tps * gpus * step / samples  # mean tokens per sample implied by the published throughput
    p = 150.0  # assumed: OpenMathInstruct-2 problems in the chat template
    rows = samples / gpus
    c = StepCounts(
        rows=rows,
        rows_per_call=rows,
        prompt_mean=p,
        response_mean=seq - p,
        rollout_prefill=prompts / gpus * p,
        train_rows=rows,
        reference=True,
        optimizer_steps=samples / 512,
        recompute=False,
    )
    notes = (
        "NeMo-RL performance summary (docs.nvidia.com/nemo/rl, About > Performance), GRPO on OpenMathInstruct-2, "
        "Llama-3.1-8B, on-policy, 16 x H100, BF16: 1,581 tokens/s/GPU, 92.8 s/step; the setting (2,048 samples, "
        "training batch 512, Megatron-core training TP 1, generation TP 1) as the page's v0.4 table gives it",
        f"{samples:,} samples per step ({prompts} prompts x 32), training batch 512 ({samples // 512} optimizer "
        f"steps); mean tokens per sample {seq:,.0f} = 1,581 x 16 x 92.8 / {samples:,} (the page's definition: "
        "training tokens / step time / GPUs)",
        f"assumed: prompt {p:.0f} tokens (so response {seq - p:,.0f}), the 32 samples of a prompt share its prefill, "
        "a reference pass (KL), no gradient checkpointing; each GPU generates its 128 rows together",
    )
    return Reference("NeMo-RL GRPO (published)", "llama-3.1-8b", "h100", gpus, step, tps, c, notes)


NEMO_RL_REFERENCE = _nemo_reference()

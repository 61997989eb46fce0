"""What the quickstart pipeline will cost, said in its first lines: the CPU profile, the dtype, and the time of
each stage estimated from a short calibration (engine/lab/calibration.py) and the config.

Every stage's time is work x calibrated rate; the work comes from the config and the pipeline's parameters:

- **games**: ``env.num_games + env.val_tasks`` generated games (none when the cache has them) at
  :data:`GAME_SECONDS` each (TextWorld's generator, Python: not calibrated);
- **evaluation** (three times): ``env.val_tasks`` episodes decoded together for ``env.max_turns`` turns (the base
  model never finishes an episode; a warm-started one :data:`TURNS_FRACTION` of them), each turn a prefill of the
  rows' prompts and the decoding steps of its longest response (the base model, which never writes the closing
  action tag, fills ``generation.max_response_length``; a warm-started one stops after ``STEPS_PER_RESPONSE``
  (engine/lab/calibrated.py) x the mean response);
- **warm start**: ``--steps`` optimizer steps of ``--batch-size`` expert examples of :data:`EXAMPLE_TOKENS`
  (prompt) + response tokens each, at the update's calibrated rate (the warm start's step runs the policy's same
  fused-head loss and optimizer step), plus playing the expert walkthroughs of ``env.num_games`` games;
- **RL steps**: ``trainer.total_steps`` steps whose phases' work is the plan's (engine/lab/step_plan.py: the
  config's batch with the quickstart's measured means where the config has only maxima), at the calibrated rates
  (engine/lab/calibrated.py), plus the environment, encoder and bookkeeping (:data:`STEP_OTHER_SECONDS`);
- the base evaluation and the RL steps, the two stages that build a model, pay the calibration's measured load time;
  every stage pays :data:`SETUP_SECONDS` (environment workers, first batch).

The constants are measured means of the quickstart's own runs (bench/results/quickstart-2026-12-02.md and
bench/results/estimate-2026-12-03.md), stated as fractions of the config's maxima where the config has maxima, so
a config with other budgets, games or steps gets another estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.lab.calibrated import STEPS_PER_RESPONSE, PhaseRates, predict_phases
from alignopsd.engine.lab.cost_model import step_work
from alignopsd.engine.lab.padding_plan import planned_counts
from alignopsd.engine.lab.step_plan import QUICKSTART_MEANS, layout
from alignopsd.engine.models.shapes import ModelShape

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

GAME_SECONDS = 0.3  # one generated easy game (10 s for 48 on the 2-core EPYC; Python work, not calibrated)
PROMPT_MEAN = 350.0  # an ALFWorld turn's prompt (history 1), tokens (rollout/prompt_length_mean of the quickstart)
RESPONSE_MEAN = 41.0  # a warm-started model's response (<think>/<action>), tokens
EXAMPLE_TOKENS = 389.0  # a warm-start example, prompt + response (93,306 tokens / 240 expert turns)
EXAMPLES_PER_GAME = 7.5  # expert turns of an easy game with the search detours (240 / 32)
EXPERT_SECONDS_PER_GAME = 0.2  # playing one game's walkthrough through the environment (6 s for 32 games)
SETUP_SECONDS = 8.0  # a stage's start besides the model load: environment workers, thinking encoder, first batch
TURNS_FRACTION = 0.85  # turns a warm-started model plays of env.max_turns in evaluation (6.1-7.75 of 8)
ENV_SECONDS_PER_TURN = 0.01  # one environment step of one episode (the workers' TextWorld step)
STEP_OTHER_SECONDS = 1.0  # per RL step: thinking encoder, selection, credit, bookkeeping
SAVE_SECONDS = 3.0  # writing a checkpoint of the 135M model (warm start, last RL step)


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    how: str


def cpu_profile_line(asked_dtype: str, device: str = "cpu") -> str:
    """The CPU profile: torch's kernel capability, the native-bf16 verdict and the dtype ``asked_dtype`` resolves to."""
    from alignopsd.engine.infra.allocator import allocator_line
    from alignopsd.engine.lab.device_limits import cpu_name
    from alignopsd.engine.parallel.hardware import BF16_CPU_FLAGS, choose_dtype, cpu_flags

    cap = torch.backends.cpu.get_cpu_capability()
    native = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
    verdict = f"native bf16 ({'/'.join(native)})" if native else "no native bf16"
    choice = choose_dtype(asked_dtype, device)
    return (
        f"[profile] CPU {cpu_name()}, {torch.get_num_threads()} threads, kernels {cap}, {verdict}; "
        f"model.dtype {choice.asked} -> {choice.name}; {allocator_line()}"
    )


def _decode_turns(
    shape: ModelShape, r: PhaseRates, rows: float, turns: float, prompt: float, steps: float, resp: float
):
    """Seconds of ``turns`` turns of ``rows`` episodes decoded together: prefill of their prompts, then ``steps``
    decoding steps producing ``rows x resp`` tokens."""
    pre = shape.linear_flops(rows * prompt) + shape.attention_flops(rows * prompt, prompt / 2) + shape.head_flops(rows)
    tok = rows * resp
    dec = shape.linear_flops(tok) + shape.attention_flops(tok, prompt + resp / 2) + shape.head_flops(tok)
    per_turn = pre / r.prefill_flops + steps * r.step_s + dec / r.decode_flops + rows * ENV_SECONDS_PER_TURN
    return turns * per_turn


def eval_stage(cfg: RunConfig, shape: ModelShape, r: PhaseRates, *, base: bool, load_s: float) -> tuple[float, str]:
    e, budget = cfg.env, cfg.generation.max_response_length
    prompt = min(PROMPT_MEAN, e.max_prompt_length)
    if base:
        turns, steps, resp = e.max_turns, budget, budget
    else:
        resp = min(RESPONSE_MEAN, budget)
        turns, steps = e.max_turns * TURNS_FRACTION, min(budget, STEPS_PER_RESPONSE * resp)
    t = load_s + SETUP_SECONDS + _decode_turns(shape, r, e.val_tasks, turns, prompt, steps, resp)
    how = f"{e.val_tasks} games x {turns:g} turns, {steps:.0f} decoding steps of {e.val_tasks} rows per turn"
    return t, how


def warm_start_stage(cfg: RunConfig, shape: ModelShape, r: PhaseRates, *, steps: int, batch: int, load_s: float):
    examples = min(steps * batch, 10**9)
    tokens_per_step = batch * min(EXAMPLE_TOKENS, cfg.env.max_prompt_length + RESPONSE_MEAN)
    fwd = shape.linear_flops(tokens_per_step) + shape.attention_flops(tokens_per_step, EXAMPLE_TOKENS / 2)
    fwd += shape.head_flops(batch * RESPONSE_MEAN)
    step_s = 3.0 * fwd / r.train_flops + r.optimizer_s  # the update's own micro-step and optimizer step
    play = cfg.env.num_games * EXPERT_SECONDS_PER_GAME
    t = load_s + play + steps * step_s + SAVE_SECONDS
    how = (
        f"{steps} steps x {batch} examples ({examples:,} examples, ~{steps * tokens_per_step:,.0f} tokens) at "
        f"{step_s:.1f} s/step, expert play of {cfg.env.num_games} games {play:.0f} s"
    )
    return t, how


def rl_stage(cfg: RunConfig, shape: ModelShape, r: PhaseRates, *, load_s: float) -> tuple[float, str, dict[str, float]]:
    q = QUICKSTART_MEANS
    # the quickstart's warm-started turns and prompts (history 1) rather than the plan's budget-filling means
    means = {**q, "turns_mean": q["max_turns"] * TURNS_FRACTION, "prompt_mean": PROMPT_MEAN}
    counts, _ = planned_counts(cfg, layout(cfg, 1), means, device_type="cpu")  # padded rows unless set free
    calls = counts.rows / max(counts.rows_per_call, 1.0)
    steps_per_call = min(cfg.generation.max_response_length, STEPS_PER_RESPONSE * counts.response_mean)
    t_resp = cfg.teacher_budget * q["teacher_response_mean"] / q["teacher_budget"]
    counts = _with_steps(counts, calls * steps_per_call, min(cfg.teacher_budget, STEPS_PER_RESPONSE * t_resp))
    esize = 4 if "32" in r.dtype else 2
    phases = predict_phases(step_work(shape, counts, dtype_bytes=esize, kv_bytes=4), r)
    env = counts.rows * ENV_SECONDS_PER_TURN
    per_step = sum(phases.values()) + env + STEP_OTHER_SECONDS
    n = cfg.trainer.total_steps
    t = load_s + SETUP_SECONDS + n * per_step + SAVE_SECONDS
    how = f"{n} steps x {per_step:.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()) + ")"
    return t, how, phases


def _with_steps(counts, rollout_steps: float, teacher_steps: float):
    from dataclasses import replace

    return replace(counts, rollout_steps=rollout_steps, teacher_steps=teacher_steps)


def estimate_pipeline(
    cfg: RunConfig, shape: ModelShape, r: PhaseRates, *, steps: int, batch: int, games: int
) -> list[Stage]:
    """The pipeline's stages (in their order) with estimated seconds; ``games``: games still to generate."""
    load_s = r.probes.get("load", 0.0)
    out = [Stage("games", games * GAME_SECONDS, f"{games} games to generate")]
    t, how = eval_stage(cfg, shape, r, base=True, load_s=load_s)
    out.append(Stage("eval base", t, how))
    # the base model's policy is the one the warm start trains and the next evaluation plays; the RL run's policy is
    # the one its evaluation plays: two model loads (engine/commands/sft.py)
    t, how = warm_start_stage(cfg, shape, r, steps=steps, batch=batch, load_s=0.0)
    out.append(Stage("warm start", t, how))
    t, how = eval_stage(cfg, shape, r, base=False, load_s=0.0)
    out.append(Stage("eval warm start", t, how))
    t, how, _ = rl_stage(cfg, shape, r, load_s=load_s)
    out.append(Stage(f"RL steps ({cfg.trainer.total_steps})", t, how))
    t, how = eval_stage(cfg, shape, r, base=False, load_s=0.0)
    out.append(Stage("eval RL", t, how))
    return out


def format_estimate(stages: list[Stage], r: PhaseRates) -> str:
    total = sum(s.seconds for s in stages)
    lines = [f"[estimate] the whole run: ~{_mmss(total)} (calibration {r.seconds:.0f} s: {r.describe()})"]
    lines += [f"[estimate]   {s.name}: ~{_mmss(s.seconds)} ({s.how})" for s in stages]
    return "\n".join(lines)


def peak_memory_line(
    cfg: RunConfig, shape: ModelShape, dtype: torch.dtype, tokens: int, process_bytes: int, *, reference: bool
) -> str:
    """The expected peak resident memory of the run's training stages, said beside the time: the process as it stands
    (``process_bytes``: libraries, tokenizer, what the calibration left), the policy's weights, gradients and AdamW
    moments (fp32 masters too for a low-precision model; a LoRA policy's base weights only), the reference model
    (``reference``: the estimator reads one and the policy is not LoRA) and one micro-batch's activations
    (``tokens`` positions at ``ModelShape.activation_bytes_per_token``). The update's peak; the other phases stay
    below it (measured: bench/results/memory-2026-12-07.md)."""
    b = torch.empty((), dtype=dtype).element_size()
    lora = cfg.model.lora.enabled
    policy = shape.params * (b if lora else b + b + 8 + (4 if b < 4 else 0))
    ref = shape.params * b if reference and not lora else 0
    act = tokens * shape.activation_bytes_per_token(b)
    gib = float(1 << 30)
    total = process_bytes + policy + ref + act
    return (
        f"[estimate] peak resident memory: ~{total / gib:.1f} GiB (the process {process_bytes / gib:.1f}, the policy's "
        f"weights, gradients and optimizer {policy / gib:.1f}, the reference {ref / gib:.1f}, a micro-batch's "
        f"activations {act / gib:.1f}: {tokens} positions)"
    )


def _mmss(s: float) -> str:
    m = int(math.floor(s / 60))
    return f"{m}m{int(round(s - 60 * m)):02d}s" if m else f"{s:.0f}s"

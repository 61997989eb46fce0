"""A short calibration of the phases on the run's own code paths (engine/lab/calibrated.py's rates).

:func:`calibrate_phases` builds the config's policy (its model, dtype and optimizer, as a run builds it), a Hugging
Face generator on it with the rollout's sampling settings (its stop strings, no end-of-sequence token, so every
row decodes the steps asked), and times, on random token ids of the model's vocabulary:

- a prefill of distinct prompts, keeping their keys/values (the teacher generation's call);
- the teacher forcing of response rows behind those kept prompts (engine/generation/prompt_cache.py);
- decoding steps at several row counts and contexts (``generate`` of n tokens minus ``generate`` of one, the
  prompt being one prompt shared by the rows, pushed once as the rollout's siblings share theirs);
- the old log-prob pass: the run's rescorer (engine/step/rescoring.py, ``trainer.rescoring_mode``) scoring one
  micro-batch of ``trainer.ppo.micro_batch_size`` rows, the rows the pass's forwards hold together (a single row
  runs slower: on the quickstart a 1-row probe read 176 GFLOP/s where the pass reached 239);
- the policy's training micro-step (``response_loss``, backward) and one optimizer step.

Each probe but the old log-prob's (timed once) runs twice and the faster run counts (the first pays for
allocation). The rows are short (a few hundred positions) so the whole takes seconds: the FLOP counts of
engine/lab/cost_model.py carry the rates to the phases' real shapes. Threads and dtype are the process's: call it
in the run's process, before the run.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.lab.calibrated import PhaseRates, fit_step
from alignopsd.engine.lab.device_limits import cpu_name
from alignopsd.engine.models.shapes import ModelShape, resolve_shape

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

# (rows, prompt length) of the decoding probes: two row counts at one context and a longer context, the least
# that identifies the fitted line's fixed cost and rate (each probe prefills twice per repetition)
DECODE_PROBES = ((2, 128), (16, 128), (16, 512))
DECODE_STEPS = 8  # tokens decoded by a probe (the difference with a one-token call is DECODE_STEPS - 1 steps)
PREFILL_PROMPT = 384  # prompt length of the prefill / teacher-forcing probe
FORCING_ROWS, FORCING_LENGTH = 6, 32  # teacher-forced rows behind the probe's prompt, and their length
TRAIN_ROWS, TRAIN_PROMPT, TRAIN_RESPONSE = 1, 320, 40  # the update probe's micro-step; the scoring probe's row shape


def best_of(fn, reps: int = 2) -> float:
    """The fastest of ``reps`` timed calls of ``fn``."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def random_ids(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, max(101, vocab - 100), (n, length), generator=g)


def forward_flops(shape: ModelShape, positions: float, context: float, logits: float) -> float:
    return shape.linear_flops(positions) + shape.attention_flops(positions, context) + shape.head_flops(logits)


def _decode_rates(gen, sampling, shape: ModelShape, probes: dict) -> tuple[float, float]:
    """(seconds per decoding step, FLOP/s of the rows' work) fitted through :data:`DECODE_PROBES`."""
    points = []
    for rows, plen in DECODE_PROBES:
        prompt = random_ids(1, plen, shape.vocab, seed=plen)[0].tolist()
        one = best_of(lambda p=prompt, r=rows: gen.generate([p] * r, replace(sampling, max_new_tokens=1)))
        many = best_of(lambda p=prompt, r=rows: gen.generate([p] * r, replace(sampling, max_new_tokens=DECODE_STEPS)))
        step = max(many - one, 1e-6) / (DECODE_STEPS - 1)
        probes[f"decode step rows={rows} context={plen}"] = step
        points.append((forward_flops(shape, rows, plen + DECODE_STEPS / 2, rows), step))
    return fit_step(points)


def _prefill_and_forcing(gen, policy, sampling, shape: ModelShape, probes: dict) -> tuple[float, float]:
    """(prefill FLOP/s, teacher-forcing FLOP/s) of one distinct prompt pushed and kept, then rows forced behind it."""
    from alignopsd.engine.generation.prompt_cache import score_cached_prompts
    from alignopsd.engine.policy.row_scoring import new_stats

    prompt = random_ids(1, PREFILL_PROMPT, shape.vocab, seed=1)[0].tolist()
    kept = {}

    def prefill() -> None:
        kept["out"] = gen.generate([prompt], replace(sampling, max_new_tokens=1), keep_prompt_cache=True)

    t_pre = best_of(prefill)
    probes["prefill"] = t_pre
    pre_flops = forward_flops(shape, PREFILL_PROMPT, PREFILL_PROMPT / 2, 1)
    cache = kept["out"].prompt_cache
    if cache is None:  # this generator keeps nothing (not the CPU decoding cache): the forcing scores plainly
        return pre_flops / t_pre, 0.0
    dev = policy.device
    resp = random_ids(FORCING_ROWS, FORCING_LENGTH, shape.vocab, seed=2).to(dev)
    mask = torch.ones_like(resp)
    rows = torch.zeros(FORCING_ROWS, dtype=torch.long, device=dev)

    def force() -> None:
        with torch.no_grad():
            score_cached_prompts(policy.hf_model, cache, rows, resp, mask, stats=new_stats())

    t_force = best_of(force)
    probes["teacher forcing"] = t_force
    n = FORCING_ROWS * FORCING_LENGTH
    return pre_flops / t_pre, forward_flops(shape, n, PREFILL_PROMPT + FORCING_LENGTH / 2, n) / t_force


def _score_rate(rescorer, shape: ModelShape, rows: int, probes: dict) -> float:
    """FLOP/s of the old log-prob pass: the run's rescorer scoring ``rows`` distinct student rows (prompt
    :data:`TRAIN_PROMPT`, response :data:`TRAIN_RESPONSE`, entropy on, as the pass asks)."""
    from alignopsd.engine.step.batch import TurnBatch

    ids = random_ids(rows, TRAIN_PROMPT + TRAIN_RESPONSE, shape.vocab, seed=3)
    zeros = torch.zeros(rows, dtype=torch.long)
    batch = TurnBatch(
        task=zeros,
        rollout=torch.arange(rows),
        turn=zeros,
        prompt_ids=ids[:, :TRAIN_PROMPT],
        prompt_mask=torch.ones(rows, TRAIN_PROMPT, dtype=torch.long),
        response_ids=ids[:, TRAIN_PROMPT:],
        response_mask=torch.ones(rows, TRAIN_RESPONSE, dtype=torch.long),
        outcome=zeros.float(),
        action_valid=torch.ones(rows, dtype=torch.bool),
    )
    # one timed call: a micro-batch's forwards last seconds, and a second call (best of two, as the short probes
    # do) doubled the calibration's longest probe for a few per cent
    t_score = best_of(lambda: rescorer.student_logprobs(batch, with_entropy=True), reps=1)
    probes[f"scoring forward rows={rows}"] = t_score
    positions = rows * (TRAIN_PROMPT + TRAIN_RESPONSE)
    return forward_flops(shape, positions, (TRAIN_PROMPT + TRAIN_RESPONSE) / 2, rows * TRAIN_RESPONSE) / t_score


def _train_rates(policy, shape: ModelShape, temperature: float, probes: dict) -> tuple[float, float]:
    """(forward+backward FLOP/s, seconds per optimizer step) at :data:`TRAIN_ROWS` rows."""
    dev = policy.device
    ids = random_ids(TRAIN_ROWS, TRAIN_PROMPT + TRAIN_RESPONSE, shape.vocab, seed=3).to(dev)
    mask = torch.ones_like(ids)

    def micro() -> None:
        _, _, carrier = policy.response_loss(
            ids, mask, TRAIN_RESPONSE, lambda lp, en: -lp.sum(), temperature=temperature
        )
        carrier.backward()

    t_train = best_of(micro)
    probes["forward+backward"] = t_train
    t_opt = best_of(lambda: policy.optimizer_step(1.0))
    probes["optimizer step"] = t_opt
    positions = TRAIN_ROWS * (TRAIN_PROMPT + TRAIN_RESPONSE)
    fwd = forward_flops(shape, positions, positions / TRAIN_ROWS / 2, TRAIN_ROWS * TRAIN_RESPONSE)
    return 3.0 * fwd / t_train, t_opt


def calibrate_phases(cfg: RunConfig, device: torch.device) -> PhaseRates:
    """Rates of the phases of ``cfg``'s run on ``device`` (see the module doc), measured with the policy, generator
    and sampling settings the run builds, in this process's threads."""
    from alignopsd.engine.models.loading import load_tokenizer
    from alignopsd.engine.run.components import build_rescorer, hf_generator
    from alignopsd.engine.run.policy_builders import build_policy
    from alignopsd.engine.step.episodes import sampling_params

    t0 = time.perf_counter()
    shape = resolve_shape(cfg.model.name)
    policy = build_policy(cfg, device)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    probes: dict[str, float] = {"load": time.perf_counter() - t0}  # what a stage that builds the policy pays first
    # the run's generator (an int8 copy where the run samples from one: time that)
    gen = hf_generator(cfg, policy, tokenizer, eos_token_ids=(), max_model_len=cfg.generation.max_model_len)
    sampling = replace(sampling_params(cfg, validation=False), seed=0)
    prefill, forcing = _prefill_and_forcing(gen, policy, sampling, shape, probes)
    step_s, decode = _decode_rates(gen, sampling, shape, probes)
    score = _score_rate(build_rescorer(cfg, policy, device, gen), shape, cfg.trainer.ppo.micro_batch_size, probes)
    train, opt = _train_rates(policy, shape, cfg.generation.temperature, probes)
    dtype = str(next(policy.hf_model.parameters()).dtype).removeprefix("torch.")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return PhaseRates(
        device=name,
        dtype=dtype,
        threads=torch.get_num_threads(),
        prefill_flops=prefill,
        step_s=step_s,
        decode_flops=decode,
        score_flops=score,
        forcing_flops=forcing or score,
        train_flops=train,
        optimizer_s=opt,
        seconds=time.perf_counter() - t0,
        probes=probes,
    )

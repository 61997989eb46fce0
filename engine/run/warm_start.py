"""The warm start's run around its steps: the policy it trains, the loop of supervised steps, the folder it writes.

The policy is the run's own (``build_policy``: the Hugging Face backend, its LoRA adapters, or Megatron shards under
tensor parallelism) with the warm start's optimizer settings: AdamW at ``--lr`` without weight decay, a linear
warm-up over the first 10% of the steps, then constant, gradients clipped to norm :data:`WARM_START_CLIP`. Each step
is the supervised recipe (engine/step/supervised.py) on a shuffled mini-batch of the examples (epochs as needed);
the checkpoint is a Hugging Face folder (fp32 safetensors, config, generation config, tokenizer and
:data:`SFT_MARKER`) written through the engine's weight writer, which a run loads with ``model.name: DIR``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.observe.memory import PeakScope, gib
from alignopsd.engine.observe.progress import time_left
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.run.policy_builders import OptimizerSettings, build_policy
from alignopsd.engine.step.packing_trial import PackingTrial
from alignopsd.engine.step.supervised import Example, supervised_step

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

SFT_MARKER = "alignopsd_sft.json"
WARM_START_CLIP = 1.0  # gradient-norm clip of every warm-start step


def warm_start_optimizer(lr: float, steps: int) -> OptimizerSettings:
    """The warm start's optimizer settings: ``lr``, no weight decay, warm-up over the first 10% of ``steps``."""
    return OptimizerSettings(lr=lr, weight_decay=0.0, warmup_steps=max(1, steps // 10))


def build_warm_start_policy(
    cfg: RunConfig, device: torch.device, *, steps: int, lr: float, world_size: int = 1
) -> PolicyBackend:
    """The config's policy (its backend, dtype, LoRA adapters, tensor parallelism) with the warm start's optimizer."""
    return build_policy(cfg, device, world_size, optim=warm_start_optimizer(lr, steps))


def train_supervised(
    policy: PolicyBackend,
    examples: list[Example],
    *,
    pad_id: int,
    steps: int,
    batch_size: int = 4,
    seed: int = 0,
    log_every: int = 10,
    fused: bool = True,
    stream=None,
    token_budget: int = 0,
) -> list[float]:
    """``steps`` supervised steps on shuffled mini-batches of ``examples`` (epochs as needed); returns the losses.
    A progress line every ``log_every`` steps (loss, tokens per second, elapsed time) goes to ``stream`` (None:
    stdout; on the first data-parallel and tensor-parallel rank only). ``fused``: through the fused head loss
    (``trainer.ppo.fused_head_loss``; :func:`~alignopsd.engine.step.supervised.supervised_step`). Where the policy's
    rows are auto (``rows`` undecided, a CPU), the first steps time packed against padded rows and keep the faster
    (engine/step/packing_trial.py). ``token_budget`` > 0: each step's rows in micro-batches of at most that many
    computed positions (``supervised_step``), which bounds the activations' memory."""
    if not examples:
        raise ValueError("examples: expected at least one expert turn")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps/batch_size: expected >= 1, got {steps}/{batch_size}")
    stream = stream if stream is not None else sys.stdout
    lead = policy.layout.dp_rank == 0 and policy.layout.is_group_lead
    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    tokens, t0 = 0, time.perf_counter()
    trial = PackingTrial(policy, policy.layout.dp_group, policy.layout.dp_size, what="warm start")
    with PeakScope() as mem:  # the peak resident memory since the first step, on every progress line
        for step in range(1, steps + 1):
            if len(order) < batch_size:
                more = list(range(len(examples)))
                rng.shuffle(more)
                order += more
            batch = [examples[i] for i in order[:batch_size]]
            del order[:batch_size]
            out = supervised_step(
                policy,
                batch,
                pad_id=pad_id,
                max_grad_norm=WARM_START_CLIP,
                fused=fused,
                trial=trial,
                token_budget=token_budget,
            )
            losses.append(out["loss"])
            tokens += sum(len(p) + len(r) for p, r in batch)
            if lead and (step % log_every == 0 or step == steps):
                dt = time.perf_counter() - t0
                left = time_left(dt, step, steps)
                print(
                    f"[sft] step {step:4d}/{steps} | loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f} | "
                    f"{tokens / dt:.0f} tok/s | {dt:.0f}s | peak mem {gib(mem.read())}"
                    + (f" | {left}" if left else ""),
                    file=stream,
                    flush=True,
                )
    return losses


def _architecture(policy: PolicyBackend) -> str:
    """The Hugging Face class name of the policy's model (written into ``config.json``)."""
    if policy.hf_model is not None:
        return type(policy.hf_model).__name__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[policy.hf_config.model_type]


def save_warm_start(
    policy: PolicyBackend, tokenizer, out_dir: str | Path, *, base: str, meta: dict, write: bool = True
) -> Path:
    """Write the policy's full weights (a LoRA policy's merged ones) as a Hugging Face folder (fp32 safetensors +
    config + generation config + tokenizer + a marker) through the engine's one weight writer
    (engine/checkpoint/weights.py): built beside ``out_dir``, listed in its manifest, then renamed into place (an
    earlier folder there is replaced whole). Collective under tensor parallelism (every rank gathers the weights);
    only a process with ``write`` writes."""
    from alignopsd.engine.checkpoint.weights import publish_folder, save_weights
    from alignopsd.engine.infra.writes import writing
    from transformers import GenerationConfig

    state = {k: v.to(torch.float32) for k, v in policy.hf_state_dict().items()}
    if not write:
        return Path(out_dir)
    hf_config = policy.hf_config
    hf_config.architectures = [_architecture(policy)]
    model = policy.hf_model
    gen_config = model.generation_config if model is not None else GenerationConfig.from_model_config(hf_config)

    def fill(tmp: Path) -> None:
        save_weights(tmp, state, hf_config)
        with writing(tmp / "generation_config.json"):
            gen_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            with writing(tmp / "tokenizer.json"):  # and the tokenizer's other files
                tokenizer.save_pretrained(tmp)
        with writing(tmp / SFT_MARKER):
            (tmp / SFT_MARKER).write_text(json.dumps({"base": base, **meta}, indent=1))

    return publish_folder(Path(out_dir), fill)

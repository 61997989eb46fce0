"""The warm start's run around its steps: its data, the policy it trains, the loop of supervised steps, the folder it
writes (``alignopsd sft``, and the quickstart pipeline's warm start stage: engine/run/pipeline.py).

The data (one example per expert turn) is the environment's own (its registry entry's ``expert_data``: ALFWorld's
walkthroughs, engine/envs/alfworld/expert.py), played through the session's environment manager: the prompt is what
the rollout would give the policy at that turn (the same chat template, tokenisation and left truncation as in
``rollout``), the response the expert's, closed with the end-of-turn token. The loss is the next-token cross entropy
on the response tokens only, averaged over them.

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
from alignopsd.engine.envs.base import ExpertTurn
from alignopsd.engine.envs.prompts import chat_text
from alignopsd.engine.envs.registry import expert_data_of
from alignopsd.engine.models.loading import resolve_model_path
from alignopsd.engine.observe.memory import PeakScope, gib
from alignopsd.engine.observe.progress import time_left
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.run.components import Games
from alignopsd.engine.run.policy_builders import (
    OptimizerSettings,
    build_policy,
    micro_batch_tokens,
    policy_placement,
    shape_of,
)
from alignopsd.engine.run.session import Session, open_session
from alignopsd.engine.step.packing_trial import PackingTrial
from alignopsd.engine.step.supervised import Example, supervised_step
from alignopsd.engine.tokens.layout import truncate_left
from alignopsd.engine.tokens.special import token_ids

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

SFT_MARKER = "alignopsd_sft.json"
WARM_START_CLIP = 1.0  # gradient-norm clip of every warm-start step


def encode_turn(tokenizer, turn: ExpertTurn, max_prompt_length: int, *, eos_id: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one example; the prompt exactly as the rollout tokenises it, the response
    closed with ``eos_id`` (the end-of-turn id of engine/tokens/special.py)."""
    ids = tokenizer(chat_text(tokenizer, turn.user_text), add_special_tokens=False)["input_ids"]
    ids, _ = truncate_left(ids, max_prompt_length)
    resp = tokenizer(turn.response, add_special_tokens=False)["input_ids"] + [int(eos_id)]
    return ids, resp


def build_examples(cfg: RunConfig, tokenizer, games: Games) -> tuple[list[ExpertTurn], list[Example]]:
    """(expert turns, encoded examples) of ``cfg``'s training games, played through ``games``' environment by its
    registry entry's ``expert_data`` (ValueError naming an environment that brings none)."""
    expert_data = expert_data_of(cfg.env.name)
    turns = expert_data(games.env, games.train_tasks, seed=cfg.trainer.seed, max_turns=cfg.env.max_turns)
    eos = token_ids(tokenizer).end_of_turn("close an expert response")
    return turns, [encode_turn(tokenizer, t, cfg.env.max_prompt_length, eos_id=eos) for t in turns]


def warm_start(session: Session, out_dir: str | Path, *, steps: int, batch_size: int, lr: float, stream=None) -> Path:
    """The warm start of the session's policy: expert examples of its training games, ``steps`` supervised steps,
    the checkpoint in ``out_dir`` (written by rank 0 once every rank has gathered the weights; every rank returns
    once it is complete)."""
    cfg, policy, tokenizer = session.cfg, session.policy, session.tokenizer
    stream = stream if stream is not None else sys.stdout
    t0 = time.perf_counter()
    turns, examples = build_examples(cfg, tokenizer, session.games)
    n_tok = sum(len(p) + len(r) for p, r in examples)
    print(f"[sft] {len(turns)} expert turns, {n_tok} tokens ({time.perf_counter() - t0:.0f}s)", file=stream, flush=True)
    losses = train_supervised(
        policy,
        examples,
        pad_id=session.ids.pad,
        steps=steps,
        batch_size=batch_size,
        seed=cfg.trainer.seed,
        fused=cfg.trainer.ppo.fused_head_loss,
        stream=stream,
        token_budget=micro_batch_tokens(cfg, shape_of(policy.hf_config, cfg.model.name), *policy_placement(policy)),
    )
    meta = {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "examples": len(examples),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": time.perf_counter() - t0,
    }
    out = save_warm_start(policy, tokenizer, out_dir, base=cfg.model.name, meta=meta, write=session.dist.rank == 0)
    session.dist.barrier()  # the folder is complete before any rank goes on
    return out


def run_sft(cfg: RunConfig, out_dir: str | Path, *, steps: int, lr: float, batch_size: int, stream=None) -> Path:
    """``alignopsd sft``: a session of the config's policy (its backend, LoRA adapters, tensor parallelism; every
    process of a ``torchrun`` launch) with the warm start's optimizer and no generator, warm-started, written to
    ``out_dir``."""
    session = open_session(cfg, optim=warm_start_optimizer(lr, steps), generate=False)
    try:
        return warm_start(session, out_dir, steps=steps, batch_size=batch_size, lr=lr, stream=stream)
    finally:
        session.close()
        session.dist.close()


_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_warm_start(path: str | Path, base: str) -> Path:
    """A warm-start checkpoint usable for model ``base``; ValueError naming the problem otherwise.

    Cheap (reads two JSON files): call it before anything heavy loads.
    """
    p = Path(path).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise ValueError(
            f"warm start: {str(p)!r} is not a checkpoint folder (config.json + *.safetensors); "
            "write one with `alignopsd sft --config FILE --out DIR`"
        )
    marker = p / SFT_MARKER
    if marker.is_file():
        made_from = json.loads(marker.read_text()).get("base")
        if made_from != base:
            raise ValueError(f"warm start: {str(p)!r} was fine-tuned from {made_from!r}, not from model {base!r}")
    mine = json.loads((p / "config.json").read_text())
    theirs = json.loads((Path(resolve_model_path(base)) / "config.json").read_text())
    diff = [k for k in _SHAPE_KEYS if mine.get(k) != theirs.get(k)]
    if diff:
        raise ValueError(
            f"warm start: {str(p)!r} belongs to another model than {base!r} "
            f"({', '.join(f'{k} {mine.get(k)} vs {theirs.get(k)}' for k in diff)})"
        )
    return p


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

"""Shared prompt prefixes in the update: what share of its positions they are, and what pushing them once saves.

    python -m bench.shared_prefix_update fraction --config configs/quickstart_cpu.yaml
    python -m bench.shared_prefix_update fraction --config configs/alfworld_7b.yaml --world-size 8
    python -m bench.shared_prefix_update time [--rounds 5] [--threads 2]

``fraction``: real ALFWorld rollouts (generated games, the engine's own environment manager, prompt builder, chat
template and rollout, engine/step/rollout.py ``collect_rollouts``) of one data-parallel rank's tasks, with a scripted
generator in place of the model: it answers ``<think>...</think><action>A</action>`` with A one of the turn's
admissible actions, its length drawn around the profile's response mean (the cost plan's: 41 of 64 tokens scaled to
``generation.max_response_length``, engine/lab/step_plan.py), and either ``agreeing`` (A picked by the prompt, so
identical prompts get one action, as a low-temperature policy's siblings often do; with probability 0.3 a sibling's
own pick instead) or ``diverse`` (every sibling its own pick: the histories diverge after the first turn). The
canonical turns go through the update's own plan (``plan_update`` with the config's mini- and micro-batch sizes and
token budget) and each micro-batch's footprint (``Footprint``: padded, packed, and packed with prefixes shared by the
update's rule); the whole-batch bound (every row of the rank in one forward) is printed beside it. The tokenizer is
SmolLM2's (the only one on this machine): Qwen2.5's chat header differs by a few tokens per prompt.

``--budget``: the micro-batches' positions (the run cuts the config's to what the activations' memory allows: on a CPU
1.5 GiB, 1,184 positions of SmolLM2-135M in fp32, 2,369 in bf16; engine/run/policy_builders.py).

``time``: the update's forwards and backwards (the fused head loss, ``HFPolicy.response_loss``) on SmolLM2-135M in
fp32 over every ``--every``-th micro-batch of one quickstart rollout (agreeing; the update's own plan at ``--budget``
positions),
interleaved in one process: ``shared`` (prefix tree where the rule takes it), ``packed`` and ``padded``
(``RowLayout.share_prefixes`` off), after a warm-up of two micro-batches each; per round the three in rotated order;
medians and ratios. ``--layers``: a shallower model where the machine is too busy for the whole one (each decoder
layer costs alike; the LM head, the same in the three variants, then weighs more, so the ratios understate the
whole model's).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import time
import zlib
from collections.abc import Callable

import torch
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.generation.base import GenerationOutput, SamplingParams
from alignopsd.engine.models.loading import load_tokenizer
from alignopsd.engine.step.micro_batches import Footprint, RowGeometry, plan_update
from alignopsd.engine.step.rollout import collect_rollouts

from alignopsd.canonical import canonicalize
from bench.provenance import commit_line, machine

GAMES = os.path.expanduser("~/.cache/alignopsd/alfworld/gen1/train-seed1-n32")
ADMISSIBLE = re.compile(r"admissible actions of the current situation are: \[(.*)\]\.", re.S)


class ScriptedGenerator:
    """The rollout's generator, answering with one of each prompt's admissible actions (module docstring)."""

    model = None
    max_model_len = 1 << 62
    keeps_prompt_cache = False

    def __init__(self, tokenizer, mean: float, cap: int, mode: str, seed: int) -> None:
        self.tok, self.mean, self.cap, self.mode = tokenizer, mean, cap, mode
        self.eos_token_ids = {int(tokenizer.eos_token_id)}
        self.rng = random.Random(seed)

    def _answer(self, prompt: str) -> str:
        found = ADMISSIBLE.search(prompt)
        actions = re.findall(r"'([^']*)'", found.group(1)) if found else []
        actions = actions or ["look"]
        own = self.rng.random() < 0.3 or self.mode == "diverse"
        pick = self.rng.choice(actions) if own else random.Random(zlib.crc32(prompt.encode())).choice(actions)
        words = max(1, int(self.rng.gauss(self.mean, 0.5 * self.mean)) - 12)
        think = " ".join(self.rng.choice(("I", "see", "the", "task", "next", "go", "to", "find")) for _ in range(words))
        return f"<think>{think}</think><action>{pick}</action>"

    def generate(self, prompts, sampling, *, keep_prompt_cache=False) -> GenerationOutput:
        ids, texts = [], []
        for p in prompts:
            t = self.tok(self._answer(self.tok.decode(p)), add_special_tokens=False)["input_ids"][: self.cap]
            ids.append(t)
            texts.append(self.tok.decode(t))
        return GenerationOutput(ids, texts, [[-0.5] * len(t) for t in ids], ["stop"] * len(ids))

    def prefill_counts(self) -> dict[str, int]:
        return {}

    def sleep(self) -> None:
        return None

    def close(self) -> None:
        return None

    def load_weights(self, state_dict) -> None:
        return None


def rollout_batch(cfg, tasks: int, mode: str, seed: int, tok=None):
    """The canonical turns of ``tasks`` tasks x ``env.group_n`` scripted episodes of ``cfg``'s profile."""
    tok = tok or load_tokenizer("smollm2-135m")
    mean = cfg.generation.max_response_length * 41 / 64
    gen = ScriptedGenerator(tok, mean, cfg.generation.max_response_length, mode, seed)
    e = cfg.env
    with EnvManager("alfworld", num_workers=2, history_length=e.history_length, max_steps=e.max_turns,
                    data_dir=GAMES) as mgr:  # fmt: skip
        pool = mgr.task_source("train", None, seed)
        batch = collect_rollouts(mgr, gen, tok, pool[:tasks], group_n=e.group_n, max_prompt_length=e.max_prompt_length,
                                 max_response_length=cfg.generation.max_response_length, max_turns=e.max_turns,
                                 sampling=SamplingParams(max_new_tokens=cfg.generation.max_response_length),
                                 seed=seed, teacher_prompts=False)  # fmt: skip
    canon = canonicalize(batch.task.tolist(), batch.rollout.tolist(), batch.turn.tolist())
    return batch.select(canon.first_row)


def fraction(cfg, world: int, mode: str, seed: int, budget: int = 0) -> dict[str, float]:
    """Positions of the update's forwards for one rank's canonical turns: padded, packed, packed and shared."""
    tp = int(cfg.policy.tensor_parallel_size) if world > 1 else 1
    dp = max(1, world // tp)
    cb = rollout_batch(cfg, max(1, cfg.env.tasks_per_step // dp), mode, seed)
    geo = RowGeometry.of(cb.prompt_mask, cb.response_mask, cb.prompt_ids)
    t = cfg.trainer.ppo
    plan = plan_update(cb.response_mask.float(), t.mini_batch_size // dp, t.micro_batch_size, 1,
                       geometry=geo, token_budget=budget or cfg.update_token_budget)  # fmt: skip
    fps = {k: Footprint() for k in ("padded", "packed", "shared")}
    for mbs in plan:
        for mb in mbs:
            fps["padded"].add(geo, mb.rows)
            fps["packed"].add(geo, mb.rows, packed=True)
            fps["shared"].add(geo, mb.rows, packed=True, share=True)
    whole = Footprint()
    whole.add(geo, list(range(cb.size)), packed=True, share=True)
    return {
        "rows": float(cb.size),
        "micro_batches": float(sum(len(m) for m in plan)),
        "prompt_mean": float(cb.prompt_mask.sum()) / cb.size,
        "response_mean": float(cb.response_mask.sum()) / cb.size,
        **{f"{k}_positions": float(fp.computed) for k, fp in fps.items()},
        "row_tokens": float(fps["packed"].row_tokens),
        "shared_fraction": 1.0 - fps["shared"].computed / fps["packed"].row_tokens,
        "whole_batch_shared_fraction": 1.0 - whole.computed / whole.row_tokens,
    }


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def time_update(rounds: int, seed: int, budget: int, every: int, layers: int) -> dict[str, list[float]]:
    """Seconds of the update's forwards and backwards (fused head loss) over one quickstart rollout's micro-batches,
    per variant and round (module docstring)."""
    from alignopsd.engine.models.loading import load_causal_lm
    from alignopsd.engine.policy.hf import HFPolicy

    cfg = load_config("configs/quickstart_cpu.yaml", [])
    cb = rollout_batch(cfg, 1, "agreeing", seed)
    geo = RowGeometry.of(cb.prompt_mask, cb.response_mask, cb.prompt_ids)
    plan = plan_update(cb.response_mask.float(), cfg.trainer.ppo.mini_batch_size, cfg.trainer.ppo.micro_batch_size, 1,
                       geometry=geo, token_budget=budget)  # fmt: skip
    micros = [mb.rows for mbs in plan for mb in mbs][::every]  # every ``every``-th: the machine is shared
    ids, attn, length = cb.input_ids(), cb.attention_mask(), cb.response_length
    model = load_causal_lm("smollm2-135m", dtype="float32")
    if layers:  # the first ``layers`` decoder layers only (every layer costs alike; the head is the same in all three)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    pol = HFPolicy(model, lr=1e-6, packed=True)
    variants = {"padded": (False, False), "packed": (True, False), "shared": (True, True)}
    sizes = {}
    for name, (packed, share) in variants.items():
        fp = Footprint()
        for rows in micros:
            fp.add(geo, rows, packed, share)
        sizes[name] = fp.computed
    print(f"{cb.size} rows, every {every}th of the micro-batches of at most {budget} positions: {len(micros)} of "
          f"{sum(len(m) for m in plan)}, {fp.row_tokens} row "
          f"tokens; positions pushed {sizes}", flush=True)  # fmt: skip

    def update(packed: bool, share: bool, first: int | None = None) -> None:
        pol.rows.packed, pol.rows.share_prefixes = packed, share
        for rows in micros[:first]:
            rmask = attn[rows, -length:].float()
            loss = lambda lp, en, m=rmask: -(lp * m).sum() / m.sum()  # noqa: E731
            _, _, carrier = pol.response_loss(ids[rows], attn[rows], length, loss)
            carrier.backward()
        pol.zero_grad()

    for v in variants.values():  # warm-up: two micro-batches each
        update(*v, first=2)
    out: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            out[name].append(timed(lambda v=variants[name]: update(*v)))
        said = ", ".join(f"{k} {v[-1]:.2f} s" for k, v in out.items())
        print(f"round {r + 1} (load {os.getloadavg()[0]:.2f}): {said}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fraction")
    f.add_argument("--config", required=True)
    f.add_argument("--world-size", type=int, default=1)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--budget", type=int, default=0, help="positions per micro-batch (0: the config's)")
    t = sub.add_parser("time")
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--every", type=int, default=4, help="time every n-th micro-batch of the update's plan")
    t.add_argument("--layers", type=int, default=0, help="keep the first n decoder layers (0: all 30)")
    t.add_argument("--budget", type=int, default=1184, help="positions per micro-batch (the fp32 run's on a CPU)")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model, flags = machine()
    print(f"commit {commit_line()}; {model}; {flags}; load {os.getloadavg()[0]:.2f}", flush=True)
    if args.what == "fraction":
        cfg = load_config(args.config, [])
        for mode in ("agreeing", "diverse"):
            res = fraction(cfg, args.world_size, mode, args.seed, args.budget)
            print(f"{cfg.name} {mode}: " + ", ".join(f"{k} {v:,.3f}" for k, v in res.items()), flush=True)
        return
    torch.set_num_threads(args.threads)
    out = time_update(args.rounds, args.seed, args.budget, args.every, args.layers)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"load at the end {os.getloadavg()[0]:.2f}; medians " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()))
    print(f"ratios: shared / packed {med['shared'] / med['packed']:.3f}, shared / padded "
          f"{med['shared'] / med['padded']:.3f}, packed / padded {med['packed'] / med['padded']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""One PPO micro-batch of a real model: the fused head loss against autograd through the log-prob kernel.

    python -m bench.bench_update [--size quick|full] [--model smollm2-135m] [--reps 3]

Both sides run the trainer's policy (``HFPolicy``) on the same rows ``[prompt | response]`` and the same
PPO-clip token-mean loss with an entropy bonus, and leave the same gradients in the parameters:

- ours: ``HFPolicy.response_loss`` (``trainer.ppo.fused_head_loss: true``, the default): the head's gradients
  are formed with the log-probs, three [N, H] x [H, V] matmuls;
- base: ``HFPolicy.response_logprobs(grad=True)`` then ``loss.backward()``: autograd through
  ``alignopsd.kernels.logprob``, whose backward recomputes the logits (four matmuls).

Time: median wall time of interleaved calls (ours, base, ours, ...) after one warm-up each, gradients
cleared before each call (outside the measurement). Peak memory: tensor allocation peak of one call from
torch's profiler memory events (``bench.measure.peak_mb``), activations and the new gradients included.
The gradients of both sides are compared (max abs difference over all parameters).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.measure import peak_mb

SIZES = {"tiny": (2, 64, 32), "quick": (4, 128, 64), "full": (8, 384, 192)}  # rows, prompt, response


def _rows(vocab: int, b: int, lp: int, lr: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (b, lp + lr), generator=g)
    mask = torch.ones(b, lp + lr, dtype=torch.long)
    for i in range(b):  # ragged: left-padded prompts, right-padded responses
        mask[i, : (i * 7) % (lp // 2)] = 0
        mask[i, lp + lr - (i * 5) % (lr // 2) :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def run(size: str = "quick", model_name: str = "smollm2-135m", reps: int = 3) -> dict:
    from alignopsd.engine.models.loading import load_causal_lm
    from alignopsd.engine.policy.hf import HFPolicy

    from alignopsd.losses import entropy_bonus, ppo_loss

    b, lp, lr = SIZES[size]
    model = load_causal_lm(model_name, dtype=torch.float32)
    pol = HFPolicy(model, lr=1e-6, ddp=False)
    ids, mask = _rows(model.config.vocab_size, b, lp, lr)
    rmask = mask[:, lp:].float()
    with torch.no_grad():
        old, _ = pol.response_logprobs(ids, mask, lr)
    adv = torch.randn(b, lr, generator=torch.Generator().manual_seed(1)) * rmask

    def loss_fn(logp, ent):
        loss, _ = ppo_loss(logp, old, adv, rmask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        return loss + entropy_bonus(ent, rmask, coef=0.001)

    params = [p for p in model.parameters() if p.requires_grad]

    def ours():
        _, _, carrier = pol.response_loss(ids, mask, lr, loss_fn, loss_fill=old, with_entropy=True)
        carrier.backward()
        return [p.grad for p in params]

    def base():
        logp, ent = pol.response_logprobs(ids, mask, lr, with_entropy=True, grad=True)
        loss_fn(logp, ent).backward()
        return [p.grad for p in params]

    t_o, t_b = [], []
    for rep in range(reps + 1):  # the first round warms up
        for fn, acc in ((ours, t_o), (base, t_b)):
            pol.zero_grad()  # outside the measurement: both start without gradients
            t0 = time.perf_counter()
            fn()
            if rep:
                acc.append((time.perf_counter() - t0) * 1e3)
    pol.zero_grad()
    mb_o, g_o = peak_mb(ours)
    g_o = [g.clone() for g in g_o]
    pol.zero_grad()
    mb_b, g_b = peak_mb(base)
    diff = max(float((a - c).abs().max()) for a, c in zip(g_o, g_b))
    scale = max(float(c.abs().max()) for c in g_b)
    tokens = int(rmask.sum())
    return dict(
        ours_ms=statistics.median(t_o),
        base_ms=statistics.median(t_b),
        ours_peak_mb=mb_o,
        base_peak_mb=mb_b,
        model=model_name,
        rows=b,
        prompt=lp,
        response=lr,
        scored_tokens=tokens,
        max_grad_diff=f"{diff:.1e}",
        max_grad=f"{scale:.1e}",
        threads=torch.get_num_threads(),
        load=f"{os.getloadavg()[0]:.1f}",
    )


def run_update_case(quick: bool = True) -> dict:
    """Entry for ``python -m bench.report`` (its --quick runs the tiny size once, to finish in two minutes)."""
    return run("tiny", reps=1) if quick else run("full", reps=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="quick")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    r = run(a.size, a.model, a.reps)
    print(
        f"ppo micro-batch ({a.model}, {r['rows']} rows, prompt {r['prompt']}, response {r['response']}, "
        f"{r['scored_tokens']} scored tokens): fused head loss {r['ours_ms']:.0f} ms, autograd {r['base_ms']:.0f} ms, "
        f"x{r['base_ms'] / r['ours_ms']:.2f}; peak {r['ours_peak_mb']:.0f} / {r['base_peak_mb']:.0f} MiB; "
        f"max |d grad| {r['max_grad_diff']} (max |grad| {r['max_grad']}); load {r['load']}"
    )


if __name__ == "__main__":
    main()

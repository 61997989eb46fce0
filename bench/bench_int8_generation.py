"""The int8 generation forward against the fp32 one, in one process, interleaved (a ratio robust to the load).

``python -m bench.bench_int8_generation [--rows 8] [--new 32] [--rounds 2] [--out FILE]``, best run under a CPU
profile: ``python -m alignopsd.engine.commands.cpu_profile avx2 -- python -m bench.bench_int8_generation``.

SmolLM2-135M (the quickstart's model) in float32; ``rows`` prompts of 400-540 tokens that share a ~200-token system
prompt (the shape of a quickstart turn), ``new`` sampled tokens each at temperature 0.5, the same seed for both.
The Hugging Face generator on the fp32 model (:class:`HFGenerator`) and on its int8 copy (:class:`Int8Generator`)
alternate ``rounds`` times; the ratio is fp32 time / int8 time. The gap: the fp32 model's teacher-forced log-probs
of the int8 samples against the int8 sampler's own, as the step's ``mismatch/*`` metrics report it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

SYSTEM = "You are an expert agent operating in the ALFRED household environment. " * 12
ROOM = (
    "You are in the middle of room {i}. Looking quickly around you, you see a cabinet {a}, a countertop {b}, a drawer "
    "{i}, a fridge 1, a garbage can 1, a microwave 1, a shelf {c}, a sink basin 1. Your task is to: put some apple in "
    "fridge. "
)


def prompts_of(tok, rows: int) -> list[list[int]]:
    out = []
    for i in range(rows):
        user = ROOM.format(i=i, a=i % 5, b=i % 3, c=i % 4) * (3 + i % 3)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        out.append(tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])
    return out


def gap(model, prompts, out, temperature: float) -> dict:
    """``mismatch/*`` of the int8 samples: the sampler's log-probs against the fp32 model's."""
    from alignopsd.rollout_correction import rollout_mismatch_metrics

    width = max(len(t) for t in out.token_ids)
    ro, tr, mask = (torch.zeros(len(prompts), width) for _ in range(3))
    for i, (p, r, lp) in enumerate(zip(prompts, out.token_ids, out.logprobs)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float() / temperature
        ro[i, : len(r)] = torch.tensor(lp)
        tr[i, : len(r)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        mask[i, : len(r)] = 1
    return {k: float(getattr(v, "value", v)) for k, v in rollout_mismatch_metrics(ro, tr, mask).items()}


def run(rows: int, new: int, rounds: int) -> dict:
    from alignopsd.engine.generation.base import SamplingParams
    from alignopsd.engine.generation.hf import HFGenerator
    from alignopsd.engine.generation.int8 import Int8Generator
    from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm("smollm2-135m", dtype="float32")
    tok = load_tokenizer("smollm2-135m")
    prompts = prompts_of(tok, rows)
    t = time.perf_counter()
    g8 = Int8Generator(model, tok)
    quantize_s = time.perf_counter() - t
    g32 = HFGenerator(model, tok)
    sp = SamplingParams(max_new_tokens=new, temperature=0.5, seed=1)
    t32 = t8 = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        g32.generate(prompts, sp)
        t32 += time.perf_counter() - t
        t = time.perf_counter()
        out = g8.generate(prompts, sp)
        t8 += time.perf_counter() - t
    lengths = [len(p) for p in prompts]
    return {"fp32_s": t32 / rounds, "int8_s": t8 / rounds, "ratio": t32 / t8, "quantize_s": quantize_s,
            "prompt_tokens": (min(lengths), max(lengths)), "gap": gap(model, prompts, out, 0.5)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="append a markdown section to this file")
    a = ap.parse_args()
    load0 = os.getloadavg()
    r = run(a.rows, a.new, a.rounds)
    g = r["gap"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    text = (
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, FBGEMM_ENABLE_INSTRUCTIONS="
        f"{os.environ.get('FBGEMM_ENABLE_INSTRUCTIONS')!r}, {torch.get_num_threads()} threads; load average "
        f"{load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n"
        f"- {a.rows} prompts of {r['prompt_tokens'][0]}-{r['prompt_tokens'][1]} tokens, {a.new} new tokens, "
        f"{a.rounds} rounds: fp32 {r['fp32_s']:.1f} s, int8 {r['int8_s']:.1f} s per round: **{r['ratio']:.2f}x**; "
        f"quantizing the copy {r['quantize_s']:.1f} s\n"
        f"- gap of the int8 samples: mismatch/kl {g['mismatch/kl']:.2e}, k3_kl {g['mismatch/k3_kl']:.2e}, "
        f"abs_diff_mean {g['mismatch/abs_diff_mean']:.3f}, abs_diff_max {g['mismatch/abs_diff_max']:.3f}, "
        f"ppl_ratio {g['mismatch/ppl_ratio']:.4f} over {g['mismatch/tokens']:.0f} tokens\n"
    )
    print(text)
    if a.out:
        with Path(a.out).open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

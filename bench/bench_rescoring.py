"""Rescoring benchmark: shared-prefix against plain teacher forcing of one realistic turn batch.

The batch follows ALGORITHM.md §4: ``tasks`` x ``rollouts`` sibling episodes x ``turns`` turns = M turns, each
with a privileged teacher prompt (left-padded, ragged lengths in [0.75, 1] x ``prompt``; the turn-0 prompts of
siblings are identical, as in a real rollout where siblings start from the same observation) and a sampled
response (ragged, [0.5, 1] x ``response``). Every target gets ``k`` cross sources from distinct sibling rollouts
of its task (any turn), so the teacher pass scores M diagonal + M*k cross rows. Both modes score exactly the
same rows with the same model and ``max_tokens`` per forward; the table reports wall time, peak memory (CUDA:
allocator peak; CPU: peak of the tensor allocations, from torch profiler memory events), the process CPU time (on a
shared machine it measures the work done better than wall time does), the token positions pushed
through the model (prompt + response; their ratio is the FLOP ratio up to attention) and the max |delta|
between the two modes' log-probs.

    python -m bench.bench_rescoring --size full     # 2 tasks x 8 rollouts x 6 turns, prompt 1024, response 128, K=3
    python -m bench.bench_rescoring --size cpu      # a CPU-sized version of the same structure
    python -m bench.bench_rescoring --size quick    # seconds; what `python -m bench.report` runs by default
    torchrun --nproc_per_node=1 -m bench.bench_rescoring --size full --counts-only --backend megatron
                                                    # the Megatron backend's plain rows vs packed shared prefixes

``run_rescoring_case(quick)`` is the entry of ``bench.report`` (case ``rescoring_shared_prefix``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import platform
import random
import time
from pathlib import Path

import torch
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.rescoring import Rescorer

from bench.measure import profile_peak_mb

SIZES = {
    "full": dict(tasks=2, rollouts=8, turns=6, prompt=1024, response=128, k=3, max_tokens=16384),
    "cpu": dict(tasks=2, rollouts=8, turns=2, prompt=512, response=64, k=3, max_tokens=8192),
    "quick": dict(tasks=2, rollouts=4, turns=2, prompt=256, response=32, k=2, max_tokens=4096),
    "tiny": dict(tasks=2, rollouts=4, turns=1, prompt=128, response=16, k=2, max_tokens=2048),
}


def make_batch(tasks, rollouts, turns, prompt, response, k, vocab, seed=0, **_) -> tuple[TurnBatch, torch.Tensor]:
    """A synthetic turn batch with teacher prompts and its [P, 2] (source, target) cross pairs."""
    rng = random.Random(seed)
    rows = [(t, r, u) for t in range(tasks) for r in range(rollouts) for u in range(turns)]
    m = len(rows)
    lo_tok = 100  # keep clear of the special tokens at the start of the vocabulary

    def toks(n):
        return [rng.randrange(lo_tok, vocab) for _ in range(n)]

    first = {t: toks(rng.randint(int(0.75 * prompt), prompt)) for t in range(tasks)}
    t_rows = [list(first[t]) if u == 0 else toks(rng.randint(int(0.75 * prompt), prompt)) for t, r, u in rows]
    r_rows = [toks(rng.randint(max(1, response // 2), response)) for _ in rows]
    t_ids = torch.zeros(m, prompt, dtype=torch.long)
    t_mask = torch.zeros(m, prompt, dtype=torch.long)
    r_ids = torch.zeros(m, response, dtype=torch.long)
    r_mask = torch.zeros(m, response, dtype=torch.long)
    for i, (tp, rp) in enumerate(zip(t_rows, r_rows)):
        t_ids[i, prompt - len(tp) :] = torch.tensor(tp)
        t_mask[i, prompt - len(tp) :] = 1
        r_ids[i, : len(rp)] = torch.tensor(rp)
        r_mask[i, : len(rp)] = 1
    index = {row: i for i, row in enumerate(rows)}
    pairs = []
    for i, (t, r, _u) in enumerate(rows):
        others = [x for x in range(rollouts) if x != r]
        for src_roll in rng.sample(others, min(k, len(others))):
            pairs.append((index[(t, src_roll, rng.randrange(turns))], i))
    batch = TurnBatch(
        task=torch.tensor([t for t, _, _ in rows]),
        rollout=torch.tensor([r for _, r, _ in rows]),
        turn=torch.tensor([u for _, _, u in rows]),
        prompt_ids=t_ids.clone(),
        prompt_mask=t_mask.clone(),
        response_ids=r_ids,
        response_mask=r_mask,
        outcome=torch.zeros(m),
        action_valid=torch.ones(m, dtype=torch.bool),
        teacher_prompt_ids=t_ids,
        teacher_prompt_mask=t_mask,
    )
    return batch, torch.tensor(pairs, dtype=torch.long)


class _PeakMemory:
    """Peak memory of a block, in MiB above the level at entry: the CUDA allocator's peak, or on CPU the peak of
    the tensor allocations made inside the block (torch profiler memory events, as ``bench.measure.peak_mb``
    measures the kernel rows; independent of the process' resident size and of allocator caching)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_mb = float("nan")

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_mb = (torch.cuda.max_memory_allocated() - self.base) / 2**20
        else:
            self.prof.__exit__(*exc)
            self.peak_mb = profile_peak_mb(self.prof)
        return False


def _load_model(device: torch.device, spec: str):
    from alignopsd.engine.models.loading import load_causal_lm

    return load_causal_lm(spec, dtype="auto", device=device)


def _time_modes(model, modes: dict, max_tokens: int, batch, pairs, dev: torch.device, reps: int):
    """Each mode's outputs, wall and process CPU seconds per rep, and its last stats.

    The modes are interleaved rep by rep, so that load drift on a shared machine hits them alike; the caller
    reports the minimum over reps (the least disturbed run: on a shared CPU, even process CPU time varies by
    +-50%)."""
    outs, times, cpu, stats = {}, {n: [] for n in modes}, {n: [] for n in modes}, {}
    for _ in range(reps):
        for name, kw in modes.items():
            rs = Rescorer(model, max_tokens=max_tokens, **kw)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            diag, cross, st = rs.teacher_logprobs(batch, pairs)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            outs[name], stats[name] = (diag, cross), st
            del diag, cross
    return outs, times, cpu, stats


def run(
    size: str = "quick",
    model_spec: str = "smollm2-135m",
    device: str | None = None,
    reps: int = 3,
    attribution: bool = False,
) -> dict:
    cfg = SIZES[size]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _load_model(dev, model_spec)
    vocab = int(model.config.vocab_size)
    batch, pairs = make_batch(vocab=vocab, **cfg)
    batch = batch.to(dev)
    pairs = pairs.to(dev)
    results = {}
    modes = {"plain": dict(mode="plain"), "shared_prefix": dict(mode="shared_prefix")}
    if attribution:  # how much of the saving is the merging of identical (turn-0 sibling) prompts
        modes["shared_prefix_nodedupe"] = dict(mode="shared_prefix", dedupe=False)
    # warm-up (allocator, kernels) on a slice
    warm = batch.select(list(range(min(4, batch.size))))
    for kw in modes.values():
        Rescorer(model, max_tokens=cfg["max_tokens"], **kw).teacher_logprobs(warm, None)
    outs, times, cpu, stats = _time_modes(model, modes, cfg["max_tokens"], batch, pairs, dev, reps)
    peaks = {n: [] for n in modes}
    for name, kw in modes.items():  # peak memory: one more call each, outside the timed ones (profiled on CPU)
        rs = Rescorer(model, max_tokens=cfg["max_tokens"], **kw)
        with _PeakMemory(dev) as pm:
            rs.teacher_logprobs(batch, pairs)
        peaks[name].append(pm.peak_mb)
    for name in modes:
        ts = sorted(times[name])
        cs = sorted(cpu[name])
        results[name] = dict(
            ms=1000 * ts[0], cpu_ms=1000 * cs[0], peak_mb=max(peaks[name]), reps=len(ts), **stats[name]
        )
    ref_d, ref_c = outs["plain"]
    for name, (d, c) in outs.items():
        results[name]["max_abs_diff_vs_plain"] = float(
            max((d - ref_d).abs().max().item(), (c - ref_c).abs().max().item() if c.numel() else 0.0)
        )
    base, ours = results["plain"], results["shared_prefix"]
    return dict(
        # the first scalar fields are what bench.report shows next to the times
        ours_token_forwards=ours["token_forwards"],
        base_token_forwards=base["token_forwards"],
        flop_ratio=round(base["token_forwards"] / max(1, ours["token_forwards"]), 3),
        turns=batch.size,
        cross_rows=int(pairs.shape[0]),
        max_abs_diff=ours["max_abs_diff_vs_plain"],
        cpu_speedup=round(base["cpu_ms"] / ours["cpu_ms"], 3),
        size=size,
        model=model_spec,
        case="rescoring_shared_prefix",
        device=str(dev),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        prompt=cfg["prompt"],
        response=cfg["response"],
        k=cfg["k"],
        max_tokens=cfg["max_tokens"],
        ours_ms=ours["ms"],
        base_ms=base["ms"],
        speedup=base["ms"] / ours["ms"],
        ours_peak_mb=ours["peak_mb"],
        base_peak_mb=base["peak_mb"],
        modes=results,
    )


def token_counts(size: str = "full") -> dict:
    """Token forwards of both modes on the ``size`` batch, measured with a 1-layer toy model (the counts depend
    only on the lengths: ``make_batch`` draws the same lengths for any vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = SIZES[size]
    torch.manual_seed(0)
    mcfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(mcfg).eval()
    batch, pairs = make_batch(vocab=1024, **cfg)
    out = {"size": size, "turns": batch.size, "cross_rows": int(pairs.shape[0])}
    for mode in ("plain", "shared_prefix"):
        _, _, st = Rescorer(model, mode=mode, max_tokens=cfg["max_tokens"]).teacher_logprobs(batch, pairs)
        out[mode] = {k: st[k] for k in ("prompt_tokens", "response_tokens", "token_forwards", "forwards")}
    out["flop_ratio"] = out["plain"]["token_forwards"] / out["shared_prefix"]["token_forwards"]
    return out


def megatron_token_counts(size: str = "full") -> dict:
    """Token forwards, forwards and attention scores (query-key pairs) of the Megatron backend's plain rows and
    packed shared prefixes on the ``size`` batch, scored by a 1-layer toy GPTModel at tensor-parallel size = the
    torchrun world size (the counts depend only on the lengths), with the max |delta| between the two and each
    mode's wall time (a toy model: attention dominates its cost, the worst case for packing)."""
    from alignopsd.engine.policy.megatron.backend import MegatronPolicy
    from alignopsd.engine.policy.row_scoring import backend_scorer
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = SIZES[size]
    torch.manual_seed(0)
    mcfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(mcfg).eval()
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    pol = MegatronPolicy(mcfg, model.state_dict(), tp=tp)
    batch, pairs = make_batch(vocab=1024, **cfg)
    out: dict = {"size": size, "turns": batch.size, "cross_rows": int(pairs.shape[0]), "tp": tp}
    res = {}
    for mode in ("plain", "shared_prefix"):
        scorer = backend_scorer(pol, mode, temperature=1.0, device=torch.device("cpu"), max_tokens=cfg["max_tokens"])
        t0 = time.perf_counter()
        diag, cross, st = Rescorer(model, mode=mode, scorer=scorer).teacher_logprobs(batch, pairs)
        keys = ("prompt_tokens", "response_tokens", "token_forwards", "forwards", "attention_scores")
        out[mode] = {k: st[k] for k in keys} | {"seconds": round(time.perf_counter() - t0, 2)}
        res[mode] = torch.cat([diag, cross])
    out["max_abs_diff"] = float((res["plain"] - res["shared_prefix"]).abs().max())
    for k in ("token_forwards", "attention_scores"):
        out[f"{k}_ratio"] = out["plain"][k] / out["shared_prefix"][k]
    return out


def run_rescoring_case(quick: bool = True) -> dict:
    """Entry for ``python -m bench.report``: quick = the tiny batch once (the report's --quick must finish in two
    minutes), else the full realistic batch."""
    return run("tiny" if quick else "full", reps=1)


def to_markdown(res: dict) -> str:
    lines = [
        f"## rescoring_shared_prefix ({res['size']}): {res['turns']} turns + {res['cross_rows']} cross rows, "
        f"teacher prompt <= {res['prompt']}, response <= {res['response']}, K={res['k']}",
        "",
        f"model {res['model']} ({res['dtype']}) on {res['device']}, max_tokens/forward {res['max_tokens']}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "",
        f"min over {res['modes']['plain']['reps']} interleaved reps",
        "",
        "| mode | wall (ms) | process CPU (ms) | peak mem (MiB) | prompt tokens | response tokens | token forwards "
        "| forwards | max abs diff vs plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["modes"].items():
        lines.append(
            f"| {name} | {r['ms']:.0f} | {r['cpu_ms']:.0f} | {r['peak_mb']:.0f} | {r['prompt_tokens']} | "
            f"{r['response_tokens']} | "
            f"{r['token_forwards']} | {r['forwards']} | {r['max_abs_diff_vs_plain']:.2e} |"
        )
    lines += [
        "",
        f"speed-up plain / shared_prefix: **{res['speedup']:.2f}x** wall, {res['cpu_speedup']:.2f}x CPU time; "
        "token-forward (FLOP) ratio: "
        f"{res['flop_ratio']:.2f}x; peak memory shared/plain: {res['ours_peak_mb']:.0f} / "
        f"{res['base_peak_mb']:.0f} MiB",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="quick")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attribution", action="store_true", help="also run shared_prefix without prompt merging")
    ap.add_argument("--counts-only", action="store_true", help="only the token-forward counts (toy model, fast)")
    ap.add_argument("--backend", choices=("hf", "megatron"), default="hf", help="--counts-only: the scoring path")
    ap.add_argument(
        "--out", default=None, help="markdown file to append to (default bench/results/rescoring-<date>.md)"
    )
    args = ap.parse_args()
    if args.counts_only:
        print(megatron_token_counts(args.size) if args.backend == "megatron" else token_counts(args.size))
        return
    res = run(args.size, args.model, args.device, args.reps, args.attribution)
    md = to_markdown(res)
    print(md)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"rescoring-{_dt.date.today()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(md + "\n")


if __name__ == "__main__":
    main()

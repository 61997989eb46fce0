"""The fused RMSNorm, SwiGLU and rotary against the stock Hugging Face modules, forward and backward, on SmolLM2-135M.

    python -m bench.fused_ops [--rounds 7] [--micro-rounds 3] [--rows 8] [--positions 464] [--threads N] [--out FILE]

Two parts, both interleaved A/B in one process (stock, fused, stock, fused ...: both sides see the same machine load
over the session), medians of ``--rounds`` pairs (``--micro-rounds`` for the micro-batch: 0 leaves it out) after one
untimed pair:

- per op: the run's own trial calls (engine/policy/fused_layers.py ``op_trials``: the stock module's code on a copy
  of the model's module against the fused op, forward and backward) at ``rows`` x ``positions`` tokens;
- the whole update micro-batch of the model's body: a training forward of ``rows`` rows of ``positions`` tokens
  through its layers (the final norm included, the LM head not: the engine's fused head is the same either way)
  and its backward, with every fused op taken (recorded chosen) against none.

The compilation's seconds are reported (this process's first calls; inductor's disk cache may spare part of it).
The machine's ``lscpu`` model and vector flags, the load average before and after and the commit head the table;
the model computes in ``--dtype`` (float32: the quickstart's on a CPU without native bf16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from bench.provenance import commit_line, machine


def _median_pair(a, b, rounds: int) -> tuple[float, float, float]:
    """(median seconds of ``a``, of ``b``, median of the per-round ratios a/b), interleaved a, b per round."""
    a(), b()
    ta, tb = [], []
    for _ in range(rounds):
        for fn, out in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb), statistics.median(x / y for x, y in zip(ta, tb))


def _choose(native: bool) -> None:
    from alignopsd.kernels.native_choice import FUSED_OPS

    from alignopsd.testing import KernelChoice, record_kernel_choice

    for op in FUSED_OPS:
        record_kernel_choice(KernelChoice(op, native, None, None, ""))


def _micro_batch(model, rows: int, positions: int):
    ids = torch.randint(0, model.config.vocab_size, (rows, positions), generator=torch.Generator().manual_seed(0))

    def step(native: bool):
        def call() -> None:
            _choose(native)
            model.zero_grad(set_to_none=True)
            hidden = model.model(input_ids=ids).last_hidden_state
            hidden.float().square().mean().backward()

        return call

    return step(False), step(True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--micro-rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", type=int, default=464)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.pop("ALIGNOPSD_CPU_PATHS", None)
    if args.threads:
        torch.set_num_threads(args.threads)
    from alignopsd.engine.models.loading import load_causal_lm
    from alignopsd.engine.policy.fused_layers import install, op_trials
    from alignopsd.kernels.fused_ops import compile_seconds
    from alignopsd.kernels.native_choice import FUSED_OPS

    commit, (cpu, flags), load0 = commit_line(), machine(), os.getloadavg()
    dtype = getattr(torch, args.dtype)
    model = load_causal_lm("smollm2-135m", dtype=dtype).train()
    stock = install(model)
    trials = op_trials(model, stock, dtype, args.rows, args.positions)
    rows = []
    for op in FUSED_OPS:
        fused, plain, shape, _ = trials[op]
        t = time.perf_counter()
        fused()
        first = time.perf_counter() - t
        s, f, r = _median_pair(plain, fused, args.rounds)
        rows.append((op, shape, s, f, r, first, compile_seconds(op)))
        print(f"{op}: stock {s * 1e3:.1f} ms, fused {f * 1e3:.1f} ms, stock/fused {r:.2f}", flush=True)
    if args.micro_rounds:
        plain, fused = _micro_batch(model, args.rows, args.positions)
        s, f, r = _median_pair(plain, fused, args.micro_rounds)
        shape = f"[{args.rows}, {args.positions}] tokens, {model.config.num_hidden_layers} layers"
        rows.append((f"update micro-batch (body, {args.micro_rounds} rounds)", shape, s, f, r, 0, 0))
        print(f"micro-batch: stock {s:.2f} s, fused {f:.2f} s, stock/fused {r:.2f}", flush=True)
    load1 = os.getloadavg()
    lines = [
        f"machine: {cpu} ({flags}); torch {torch.__version__}, {torch.get_num_threads()} threads; {args.dtype}",
        f"commit: {commit}; load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
        f"after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; {args.rounds} interleaved rounds, medians",
        "",
        "| op | shape | stock (ms) | fused (ms) | stock/fused (median) | first fused call (s) | compiling (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for op, shape, s, f, r, first, comp in rows:
        lines.append(f"| {op} | {shape} | {s * 1e3:.1f} | {f * 1e3:.1f} | {r:.2f} | {first:.1f} | {comp:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with args.out.open("a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()

"""What each custom CPU path is worth on this CPU, and what a run chooses here.

    python -m bench.cpu_paths [--rows 3800] [--reps 3]

The LM head's GEMM ``[rows, 576] x [49152, 576]`` (SmolLM2-135M's head, the issue's shape) several ways: torch's bf16
matmul (bf16 output: what AMX accelerates; the logits rounded to bf16, which the run cannot use), torch's fp32 matmul
of upcast operands, the bf16 GEMM with fp32 results (``bf16_gemm.mm_bf16``, where torch's CPU library has it), the
engine's torch partials (``torch_tiles.torch_partials``: online logsumexp over fp32 tiles, then over bf16-GEMM
tiles), the C++ head kernel (``cpu_partials.native_partials``, where it runs), and the update's fused loss forward and
backward (``fused_loss.logprob_loss_and_grad``, three GEMMs: fp32 tiles, then bf16 GEMMs; its rate counts the three);
then the choice a run makes at startup
(``engine/run/kernel_probe.py``, this process's measurement) and the device limit the cost tables read
(``device_limits.calibrate`` in bf16 at the model's MLP shape). Best of ``--reps`` timed calls after one warm-up.
"""

from __future__ import annotations

import argparse
import os

import torch

HIDDEN, VOCAB, INTERMEDIATE = 576, 49152, 1536  # SmolLM2-135M


def main(argv: list[str] | None = None) -> None:
    from alignopsd.engine.lab.device_limits import calibrate, cpu_name
    from alignopsd.engine.run.kernel_probe import choose_cpu_kernels
    from alignopsd.kernels import native_choice
    from alignopsd.kernels.cpp import why_not_ready
    from alignopsd.kernels.head.bf16_gemm import gemm_ready, mm_bf16, why_no_gemm
    from alignopsd.kernels.head.cpu_partials import native_applies, native_partials
    from alignopsd.kernels.head.fused_loss import logprob_loss_and_grad
    from alignopsd.kernels.head.torch_tiles import torch_partials
    from alignopsd.kernels.native_choice import HEAD_GEMM, KernelChoice, best_seconds, record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3800)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.pop(native_choice.PIN_ENV, None)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.rows, HIDDEN, generator=g).bfloat16()
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5).bfloat16()
    t = torch.randint(0, VOCAB, (args.rows,), generator=g)
    flops = 2.0 * args.rows * HIDDEN * VOCAB
    hf, wf = h.float(), w.float()
    z = torch.empty(args.rows, VOCAB)

    def loss(lp, ent, idx):
        return -lp

    cases = {  # name -> (call, the head GEMMs' choice it runs under or None, GEMMs per call)
        "torch bf16 matmul (bf16 logits)": (lambda: torch.mm(h, w.T), None, 1),
        "torch fp32 matmul (upcast operands)": (lambda: torch.mm(hf, wf.T), None, 1),
        "engine torch partials (fp32 tiles)": (lambda: torch_partials(h, w, None, t, 1.0, 0), False, 1),
        "fused loss forward + backward (fp32 tiles)": (lambda: logprob_loss_and_grad(h, w, t, loss), False, 3),
    }
    if gemm_ready():
        cases["bf16 GEMM with fp32 results"] = (lambda: mm_bf16(h, w.T, z), None, 1)
        cases["engine torch partials (bf16 GEMM tiles)"] = (lambda: torch_partials(h, w, None, t, 1.0, 0), True, 1)
        cases["fused loss forward + backward (bf16 GEMMs)"] = (lambda: logprob_loss_and_grad(h, w, t, loss), True, 3)
    if native_applies(h, w, None):
        cases["engine C++ head kernel (bf16 products, fp32 sums)"] = (lambda: native_partials(h, w, t, 1.0, 0), None, 1)
    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} threads; torch {torch.__version__}; load {os.getloadavg()}")
    print(f"C++ kernels: {why_not_ready() or 'ready'}; bf16 GEMM with fp32 results: {why_no_gemm() or 'ready'}\n")
    print(f"| [{args.rows}, {HIDDEN}] x [{VOCAB}, {HIDDEN}] | ms | GFLOP/s |")
    print("|---|---:|---:|")
    for name, (fn, gemm, n_gemm) in cases.items():
        if gemm is not None:
            record(KernelChoice(HEAD_GEMM, gemm, None, None, "", why="set by the benchmark"))
        s = best_seconds(fn, reps=args.reps, min_time=0.0)
        print(f"| {name} | {s * 1e3:.1f} | {n_gemm * flops / s / 1e9:.0f} |")
    native_choice.forget()

    class Smol:
        hidden_size, vocab_size, num_attention_heads, num_key_value_heads = HIDDEN, VOCAB, 9, 3

    print("\nThe run's choice at startup (engine/run/kernel_probe.py, bf16):")
    for line in choose_cpu_kernels(Smol, torch.bfloat16):
        print(f"- {line}")
    lim = calibrate(HIDDEN, INTERMEDIATE, torch.bfloat16)
    print(f"\nDevice limit (bf16): {lim.describe()}")


if __name__ == "__main__":
    main()

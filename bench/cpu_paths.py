"""What each custom CPU path is worth on this CPU, and what a run chooses here.

    python -m bench.cpu_paths [--rows 3800] [--reps 3]

The LM head's GEMM ``[rows, 576] x [49152, 576]`` (SmolLM2-135M's head, the issue's shape) four ways: torch's bf16
matmul (bf16 output: what AMX accelerates; the logits rounded to bf16, which the run cannot use), torch's fp32 matmul
of upcast operands, the engine's torch partials (``lse_partials.torch_partials``: fp32 tiles, online logsumexp) and
the C++ head kernel (``lse_native.native_partials``, where it runs); then the choice a run makes at startup
(``engine/run/kernel_probe.py``, this process's measurement) and the device limit the cost tables read
(``device_limits.calibrate`` in bf16 at the model's MLP shape). Best of ``--reps`` timed calls after one warm-up.
"""

from __future__ import annotations

import argparse
import os

import torch

HIDDEN, VOCAB, INTERMEDIATE = 576, 49152, 1536  # SmolLM2-135M


def main(argv: list[str] | None = None) -> None:
    from alignopsd.engine.cost.device_limits import calibrate, cpu_name
    from alignopsd.engine.run.kernel_probe import choose_cpu_kernels
    from alignopsd.kernels import native_choice
    from alignopsd.kernels.lse_native import native_applies, native_partials, why_not_ready
    from alignopsd.kernels.lse_partials import torch_partials
    from alignopsd.kernels.native_choice import best_seconds

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
    cases = {
        "torch bf16 matmul (bf16 logits)": lambda: torch.mm(h, w.T),
        "torch fp32 matmul (upcast operands)": lambda: torch.mm(hf, wf.T),
        "engine torch partials (fp32 tiles)": lambda: torch_partials(h, w, None, t, 1.0, 0),
    }
    if native_applies(h, w, None):
        cases["engine C++ head kernel (bf16 products, fp32 sums)"] = lambda: native_partials(h, w, t, 1.0, 0)
    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} threads; torch {torch.__version__}; load {os.getloadavg()}")
    print(f"C++ kernels: {why_not_ready() or 'ready'}\n")
    print(f"| [{args.rows}, {HIDDEN}] x [{VOCAB}, {HIDDEN}] | ms | GFLOP/s |")
    print("|---|---:|---:|")
    for name, fn in cases.items():
        s = best_seconds(fn, reps=args.reps, min_time=0.0)
        print(f"| {name} | {s * 1e3:.1f} | {flops / s / 1e9:.0f} |")

    class Smol:
        hidden_size, vocab_size, num_attention_heads, num_key_value_heads = HIDDEN, VOCAB, 9, 3

    print("\nThe run's choice at startup (engine/run/kernel_probe.py, bf16):")
    for line in choose_cpu_kernels(Smol, torch.bfloat16):
        print(f"- {line}")
    lim = calibrate(HIDDEN, INTERMEDIATE, torch.bfloat16)
    print(f"\nDevice limit (bf16): {lim.describe()}")


if __name__ == "__main__":
    main()

"""Packed rows on the CPU: padded rows against packed rows with row-by-row attention and with the block-diagonal mask.

    python -m bench.packed_attention [--model smollm2-135m] [--dtype auto] [--positions 8704] [--width 1088]
        [--reps 3] [--skip-mask]

One micro-batch of the update's size (the quickstart's: 8 rows of up to 1,088 positions; lengths spread from half
the width to the width, left-padded, as the run's packing probe builds them, engine/run/kernel_probe.py) through
the model's transformer body three ways, interleaved (padded, row by row, mask, padded, ...), best of ``--reps``
after one warm-up each:

- padded: ``[B, T]`` rows with their padding mask (the model's SDPA);
- packed, row by row: ``lm_head.packed_forward`` (engine/policy/varlen_attention.py: SDPA with ``is_causal`` on each
  row's segment of the one packed sequence);
- packed, mask: the same packed sequence through the model's own attention, which builds the ``[N, N]``
  block-diagonal mask from the position ids (what packed rows cost on a CPU before row-by-row attention).

Forward without gradients (what the old log-prob and reference passes and the run's packing probe do) and forward
with backward of a scalar of the hidden states (the update's shape of work). Ratios are against the padded rows
of the same run. The largest difference of the attended positions' hidden states, padded against row by row, is
printed (fp32: rounding only).
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _rows(vocab: int, positions: int, width: int):
    g = torch.Generator().manual_seed(0)
    rows = max(2, positions // width)
    lengths = torch.linspace(width // 2, width, rows).round().long()
    mask = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()
    return torch.randint(0, vocab, (rows, width), generator=g) * mask, mask


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.models.loading import load_causal_lm, parse_dtype
    from alignopsd.engine.policy.lm_head import packed_forward, packed_inputs, transformer_body
    from alignopsd.engine.tokens.layout import position_ids

    p = argparse.ArgumentParser(prog="python -m bench.packed_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--positions", type=int, default=8704, help="positions of the micro-batch (rows x width)")
    p.add_argument("--width", type=int, default=1088, help="the longest row")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-mask", action="store_true", help="leave out the block-diagonal mask (the slowest)")
    a = p.parse_args(argv)
    model = load_causal_lm(a.model, dtype=parse_dtype(a.dtype))
    body = transformer_body(model)
    ids, mask = _rows(model.config.vocab_size, a.positions, a.width)
    ids_1N, pos_1N, _ = packed_inputs(ids, mask)
    print(f"{a.model} {next(model.parameters()).dtype}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(f"{ids.shape[0]} rows x {ids.shape[1]}: {ids_1N.shape[1]} of {ids.numel()} positions attended")

    ways = {
        "padded": lambda: body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False),
        "packed, row by row": lambda: packed_forward(body, ids_1N, pos_1N),
        "packed, mask": lambda: body(input_ids=ids_1N, attention_mask=None, position_ids=pos_1N, use_cache=False),
    }
    if a.skip_mask:
        ways.pop("packed, mask")
    with torch.no_grad():
        h_pad = ways["padded"]().last_hidden_state[mask.bool()].float()
        h_row = ways["packed, row by row"]().last_hidden_state[0].float()
    print(f"max |padded - row by row| of the attended positions' hidden states: {(h_pad - h_row).abs().max():.2e}")

    def forward(fn) -> float:
        with torch.no_grad():
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

    def with_backward(fn) -> float:
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        fn().last_hidden_state.float().pow(2).mean().backward()
        return time.perf_counter() - t

    best: dict[str, dict[str, float]] = {k: {} for k in ways}
    for name, timer in (("forward", forward), ("forward+backward", with_backward)):
        for fn in ways.values():
            timer(fn)  # warm-up
        for _ in range(a.reps):
            for k, fn in ways.items():
                best[k][name] = min(best[k].get(name, float("inf")), timer(fn))
    print("| rows | forward (s) | vs padded | forward+backward (s) | vs padded |")
    print("|---|---:|---:|---:|---:|")
    base = best["padded"]
    for k, b in best.items():
        f, fb = b["forward"], b["forward+backward"]
        print(f"| {k} | {f:.2f} | {base['forward'] / f:.2f}x | {fb:.2f} | {base['forward+backward'] / fb:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one checkpoint of a policy costs: the trainer's own writer on a real model, timed.

    python -m bench.save_cost [--model smollm2-135m] [--dtype bfloat16] [--saves 3]

Builds the Hugging Face policy the trainer builds (its AdamW state filled by one optimizer step, so the optimizer
file is full size), then writes ``--saves`` checkpoints with ``engine/checkpoint/checkpoint.py save_checkpoint``
(weights, optimizer state, this rank's RNG, trainer state, the manifest with every file's checksum, the atomic
rename, the rotation to ``keep_last``) into a temporary folder, and verifies the last one as a resume does. Prints
seconds per save and per verification and the checkpoint's size.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    from alignopsd.engine.checkpoint.checkpoint import save_checkpoint, verify_checkpoint
    from alignopsd.engine.checkpoint.trainer_state import TrainerState
    from alignopsd.engine.lab.device_limits import cpu_name
    from alignopsd.engine.models.loading import load_causal_lm
    from alignopsd.engine.policy.hf import HFPolicy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args(argv)
    model = load_causal_lm(args.model, dtype=args.dtype)
    pol = HFPolicy(model, lr=1e-6, ddp=False)
    for p in pol.params:  # one step fills AdamW's moments (and the fp32 masters of a bf16 model)
        p.grad = torch.zeros_like(p)
    pol.optimizer_step(1.0)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, args.saves + 1):
            t = time.perf_counter()
            path = save_checkpoint(
                Path(tmp),
                step,
                model_state=pol.hf_state_dict(),
                optimizer_state=pol.optimizer_state(),
                trainer_state=TrainerState(step=step),
                hf_config=pol.hf_config,
                keep_last=2,
            )
            times.append(time.perf_counter() - t)
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        t = time.perf_counter()
        verify_checkpoint(path)
        verify_s = time.perf_counter() - t
    print(f"CPU {cpu_name()}, {torch.get_num_threads()} threads; {args.model} in {args.dtype}")
    saves = ", ".join(f"{s:.2f}" for s in times)
    print(f"checkpoint size {size / 2**20:.0f} MiB; save seconds {saves}; verification {verify_s:.2f} s")


if __name__ == "__main__":
    main()

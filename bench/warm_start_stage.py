"""Time the quickstart's warm start stage and its held-out evaluation, as ``make run`` runs them.

``python -m bench.warm_start_stage [--config configs/quickstart_cpu.yaml] [--steps 60] [--out DIR]``: the easy
games (``--easy-games``), the warm start with the pipeline's settings (``--steps``, lr 1e-4, batch 4) and the
held-out evaluation of its checkpoint, through the pipeline's own stage functions (engine/commands/sft.py).
Prints one JSON line: the two stage times and the held-out row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.commands import sft
    from alignopsd.engine.config.schema import load_config

    p = argparse.ArgumentParser(prog="bench.warm_start_stage")
    p.add_argument("--config", default="configs/quickstart_cpu.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=None, help="warm-start folder (default: a temporary one)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, [])
    overrides = [f"env.data_dir={sft.easy_games_root(cfg)[0]}"]
    cfg = load_config(args.config, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or Path(tmp) / "sft")
        t0 = time.perf_counter()
        sft.run_sft(cfg, out, steps=args.steps, lr=1e-4, batch_size=4, stream=sys.stderr)
        warm_s = time.perf_counter() - t0
        rl_cfg = load_config(args.config, overrides + [f"model.name={out}", "trainer.val_after_train=false"])
        times: dict[str, float] = {}
        row = sft._heldout(rl_cfg, None, "warm start", times, sys.stderr)
    print(json.dumps({"warm_start_s": round(warm_s, 1), "eval_s": round(times["eval warm start"], 1), "row": row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the quickstart's warm start stage and its held-out evaluation, as ``make run`` runs them.

``python -m bench.warm_start_stage [--config configs/quickstart_cpu.yaml] [--steps 60] [--out DIR]``: the easy
games (``--easy-games``), the warm start with the pipeline's settings (``--steps``, lr 1e-4, batch 4) and the
held-out evaluation of the warm-started policy, through the pipeline's own stage functions (engine/commands/sft.py):
the warm start's time counts its policy's build (which the pipeline does before the base evaluation), the held-out
games' environment (built once per pipeline) is timed apart. Prints one JSON line: the times and the held-out row.
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
    from alignopsd.engine.models.loading import load_tokenizer
    from alignopsd.engine.run.heldout import heldout_games, heldout_metrics
    from alignopsd.engine.run.process import pick_device, process_settings
    from alignopsd.engine.run.warm_start import build_warm_start_policy

    p = argparse.ArgumentParser(prog="bench.warm_start_stage")
    p.add_argument("--config", default="configs/quickstart_cpu.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=None, help="warm-start folder (default: a temporary one)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, [])
    cfg = sft.derived_config(cfg, env={"data_dir": str(sft.easy_games_root(cfg)[0])})
    device = pick_device(cfg)
    process_settings(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    t0 = time.perf_counter()
    games = heldout_games(cfg)  # the pipeline builds them once, before its first evaluation
    games_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(args.out or Path(tmp) / "sft")
            t0 = time.perf_counter()  # the policy is built for the base evaluation in the pipeline: counted here
            policy = build_warm_start_policy(cfg, device, steps=args.steps, lr=1e-4)
            build_s = time.perf_counter() - t0
            sft.warm_start(cfg, policy, tokenizer, out, steps=args.steps, batch_size=4, lr=1e-4, stream=sys.stderr)
            warm_s = time.perf_counter() - t0
            rl_cfg = sft.derived_config(
                cfg,
                model={"name": str(out)},
                trainer={"validation": cfg.trainer.validation.model_copy(update={"after_train": False})},
            )
            t0 = time.perf_counter()
            m = heldout_metrics(rl_cfg, policy, tokenizer, games, device=device)
            eval_s = time.perf_counter() - t0
    finally:
        games.close()
    res = {
        "warm_start_s": round(warm_s, 1),
        "policy_build_s": round(build_s, 1),
        "eval_s": round(eval_s, 1),
        "heldout_games_s": round(games_s, 1),
        "row": {k: m.get(f"episode/{k}") for k in ("success_rate", "valid_action_rate", "turns_mean", "count")},
    }
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

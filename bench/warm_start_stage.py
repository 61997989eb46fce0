"""Time the quickstart's warm start stage and its held-out evaluation, as ``make run`` runs them.

``python -m bench.warm_start_stage [--config configs/quickstart_cpu.yaml] [--steps 60] [--out DIR]``: the easy
games (``--easy-games``), the warm start with the pipeline's settings (``--steps``, lr 1e-4, batch 4) and the
held-out evaluation of the warm-started policy, through the pipeline's own stage functions (engine/run/pipeline.py,
engine/run/warm_start.py): the session the pipeline opens before its base evaluation (policy, generator, held-out
games' environment) is timed apart. Prints one JSON line: the times and the held-out row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.heldout import heldout_metrics
    from alignopsd.engine.run.pipeline import derived_config, easy_games_root
    from alignopsd.engine.run.session import open_session
    from alignopsd.engine.run.warm_start import warm_start, warm_start_optimizer

    p = argparse.ArgumentParser(prog="bench.warm_start_stage")
    p.add_argument("--config", default="configs/quickstart_cpu.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=None, help="warm-start folder (default: a temporary one)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, [])
    cfg = derived_config(cfg, env={"data_dir": str(easy_games_root(cfg)[0])})
    t0 = time.perf_counter()  # the pipeline opens its session (policy, generator, games) before the base evaluation
    session = open_session(cfg, optim=warm_start_optimizer(1e-4, args.steps))
    session_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(args.out or Path(tmp) / "sft")
            t0 = time.perf_counter()
            warm_start(session, out, steps=args.steps, batch_size=4, lr=1e-4, stream=sys.stderr)
            warm_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            m = heldout_metrics(session)
            eval_s = time.perf_counter() - t0
    finally:
        session.close()
    res = {
        "warm_start_s": round(warm_s, 1),
        "session_s": round(session_s, 1),
        "eval_s": round(eval_s, 1),
        "row": {k: m.get(f"episode/{k}") for k in ("success_rate", "valid_action_rate", "turns_mean", "count")},
    }
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

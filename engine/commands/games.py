"""``alignopsd games alfworld --n N --out DIR``: generate expert-verified game files (engine/envs/alfworld/gen.py)."""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="alignopsd games", description="Generate expert-verified game files.")
    p.add_argument("env", choices=["alfworld"], help="which environment's games to generate")
    p.add_argument("--n", type=int, required=True, help="number of games")
    p.add_argument("--out", required=True, help="output directory (alfworld layout: OUT/json_2.1.1/<split>/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="train", choices=["train", "valid_seen", "valid_unseen"])
    p.add_argument("--workers", type=int, default=1, help="processes generating and verifying games")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n: must be >= 1, got {args.n}")
    from alignopsd.engine.envs.alfworld.gen import generate_games

    paths = generate_games(args.n, args.out, seed=args.seed, split=args.split, workers=args.workers)
    print(f"wrote {len(paths)} {args.split} games under {args.out}")
    return 0

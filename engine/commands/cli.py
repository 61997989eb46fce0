"""The ``alignopsd`` console command.

    alignopsd train   --config FILE [--set k=v ...] [--resume auto]     (also under torchrun)
    alignopsd eval    --config FILE [--checkpoint DIR] [--json FILE]
    alignopsd profile --config FILE [--steps N] [--estimators grpo,alignopsd] [--json FILE]
    alignopsd compare --config FILE --steps N [--estimators grpo,alignopsd] [--seeds 3] [--eval-every K] [--out DIR]
    alignopsd sft     --config FILE [--out DIR] [--steps N] [--easy-games] [--pipeline] [--warm-start DIR]
    alignopsd games   alfworld --n 120 --out DIR [--seed S] [--split train]
    alignopsd serve-retriever --corpus FILE [--host H] [--port P]
    alignopsd memory  --config FILE [--set k=v ...] [--world-size N] [--gpu-gib G]   (Megatron, per rank)
    alignopsd plan    --config FILE --gpu a800 --world-size N [--set k=v ...]   (time per phase, roofline)

Each subcommand parses its own options (``alignopsd <cmd> --help``); nothing heavy is imported before a
subcommand is chosen.
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = ("train", "eval", "profile", "compare", "sft", "games", "serve-retriever", "memory", "plan")


def games_main(argv: list[str]) -> int:
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from alignopsd.engine.run.trainer import main as run
    elif cmd == "eval":
        from alignopsd.engine.commands.evaluate import main as run
    elif cmd == "profile":
        from alignopsd.engine.commands.profile import main as run
    elif cmd == "compare":
        from alignopsd.engine.commands.compare import main as run
    elif cmd == "sft":
        from alignopsd.engine.commands.sft import main as run
    elif cmd == "games":
        run = games_main
    elif cmd == "serve-retriever":
        from alignopsd.engine.envs.search.retriever import main as run
    elif cmd == "memory":
        from alignopsd.engine.policy.megatron.memory import main as run
    elif cmd == "plan":
        from alignopsd.engine.commands.plan import main as run
    else:
        print(f"alignopsd: unknown command {cmd!r}; allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

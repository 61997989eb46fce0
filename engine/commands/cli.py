"""The ``alignopsd`` console command.

    alignopsd train   --config FILE [--set k=v ...] [--resume auto]     (also under torchrun)
    alignopsd eval    --config FILE [--checkpoint DIR] [--json FILE]
    alignopsd profile --config FILE [--steps N] [--estimators grpo,alignopsd] [--json FILE]
    alignopsd compare --config FILE --steps N [--estimators grpo,alignopsd] [--seeds 3] [--eval-every K] [--out DIR]
    alignopsd ablate  --config FILE [--checkpoint DIR] [--estimators grpo,alignopsd_A,...,alignopsd] [--batches N]
                      [--out FILE]   (every estimator's update from one point on the same batches)
    alignopsd sft     --config FILE [--out DIR] [--steps N] [--easy-games] [--pipeline] [--warm-start DIR]
    alignopsd games   alfworld --n 120 --out DIR [--seed S] [--split train]
    alignopsd games   webshop --out DIR [--seed S] [--products N] [--goals N]
    alignopsd serve-retriever --corpus FILE [--host H] [--port P]
    alignopsd memory  --config FILE [--set k=v ...] [--world-size N] [--gpu-gib G]   (Megatron, per rank)
    alignopsd plan    --config FILE --gpu a800 --world-size N [--set k=v ...]   (time per phase, roofline)

Each subcommand parses its own options (``alignopsd <cmd> --help``); nothing heavy is imported before a
subcommand is chosen.
"""

from __future__ import annotations

import sys

COMMANDS = ("train", "eval", "profile", "compare", "ablate", "sft", "games", "serve-retriever", "memory", "plan")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a command line (not a call from Python): the process takes the run's allocator first
        from alignopsd.engine.infra.allocator import restart_under

        restart_under(sys.argv[1:], "alignopsd.engine")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from alignopsd.engine.commands.train import main as run
    elif cmd == "eval":
        from alignopsd.engine.commands.evaluate import main as run
    elif cmd == "profile":
        from alignopsd.engine.commands.profile import main as run
    elif cmd == "compare":
        from alignopsd.engine.commands.compare import main as run
    elif cmd == "ablate":
        from alignopsd.engine.commands.ablate import main as run
    elif cmd == "sft":
        from alignopsd.engine.commands.sft import main as run
    elif cmd == "games":
        from alignopsd.engine.commands.games import main as run
    elif cmd == "serve-retriever":
        from alignopsd.engine.commands.serve_retriever import main as run
    elif cmd == "memory":
        from alignopsd.engine.commands.memory import main as run
    elif cmd == "plan":
        from alignopsd.engine.commands.plan import main as run
    else:
        print(f"alignopsd: unknown command {cmd!r}; allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

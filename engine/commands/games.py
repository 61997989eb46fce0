"""``alignopsd games``: write an environment's generated data in the layout of its official data.

alignopsd games alfworld --n N --out DIR [--seed S] [--split train] [--workers W]
    expert-verified ALFWorld game files (engine/envs/alfworld/gen.py), OUT/json_2.1.1/<split>/
alignopsd games webshop --out DIR [--seed S] [--products N] [--goals N]
    the generated WebShop catalogue and goals (engine/envs/webshop/generate.py) as WebShop's original files
    (items_shuffle.json, items_ins_v2.json, items_human_ins.json: engine/envs/webshop/data.py)
"""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.envs.webshop.generate import DEFAULT_N_GOALS, DEFAULT_N_PRODUCTS

    p = argparse.ArgumentParser(prog="alignopsd games", description="Write an environment's generated data.")
    envs = p.add_subparsers(dest="env", required=True, metavar="{alfworld,webshop}")
    alf = envs.add_parser("alfworld", help="expert-verified ALFWorld game files")
    alf.add_argument("--n", type=int, required=True, help="number of games")
    alf.add_argument("--out", required=True, help="output directory (alfworld layout: OUT/json_2.1.1/<split>/)")
    alf.add_argument("--seed", type=int, default=0)
    alf.add_argument("--split", default="train", choices=["train", "valid_seen", "valid_unseen"])
    alf.add_argument("--workers", type=int, default=1, help="processes generating and verifying games")
    web = envs.add_parser("webshop", help="the generated WebShop catalogue in the original file layout")
    web.add_argument("--out", required=True, help="output directory (the files env.data_dir reads)")
    web.add_argument("--seed", type=int, default=0)
    web.add_argument("--products", type=int, default=DEFAULT_N_PRODUCTS, help="products in the catalogue")
    web.add_argument("--goals", type=int, default=DEFAULT_N_GOALS, help="goals (instructions)")
    args = p.parse_args(argv)
    if args.env == "alfworld":
        if args.n < 1:
            alf.error(f"--n: must be >= 1, got {args.n}")
        from alignopsd.engine.envs.alfworld.gen import generate_games

        paths = generate_games(args.n, args.out, seed=args.seed, split=args.split, workers=args.workers)
        print(f"wrote {len(paths)} {args.split} games under {args.out}")
        return 0
    from alignopsd.engine.envs.webshop.data import write_original_layout
    from alignopsd.engine.envs.webshop.generate import generate_catalogue

    try:
        products, goals, _ = generate_catalogue(args.seed, args.products, args.goals)
    except ValueError as exc:  # names the count: n_products / n_goals
        web.error(str(exc))
    for name, path in write_original_layout(products, goals, args.out).items():
        print(f"{name}: {path}")
    return 0

"""The update's padding on a synthetic batch with a profile's row lengths: fixed rows, micro-batches by tokens, packed.

    python -m bench.padding_profile [--config configs/alfworld_7b.yaml] [--rows 2048] [--seed 0]

The rows' lengths are the cost plan's synthetic batch (engine/lab/padding_plan.py ``synthetic_row_masks``: the
config's maxima scaled by the quickstart's measured means, prompt mean 400 of 1,024, response mean 41 of 64, spread
as a normal of standard deviation 35 % (prompts) and 50 % (responses) of the mean, clipped to [64, max] and [8,
max]); the recipe was fixed before any result. The plan
is the update's own (engine/step/micro_batches.py ``plan_update`` on one rank, the config's mini- and micro-batch
sizes and ``trainer.ppo.max_token_len_per_gpu``), and the positions are its ``Footprint``: the padded forwards of fixed
rows (``trainer.ppo.max_token_len_per_gpu: 0``, the plan before micro-batches by tokens), of micro-batches by tokens
(rows sorted by length), and of the same micro-batches packed (``use_remove_padding``).
"""

from __future__ import annotations

import argparse

from alignopsd.engine.config.schema import load_config
from alignopsd.engine.lab.padding_plan import synthetic_row_masks
from alignopsd.engine.step.micro_batches import RowGeometry, plan_footprint, plan_update


def measure(cfg, rows: int, seed: int) -> dict[str, dict[str, float]]:
    pmask, rmask = synthetic_row_masks(cfg, rows, seed)
    geo = RowGeometry.of(pmask, rmask)
    mini, micro = cfg.trainer.ppo.mini_batch_size, cfg.trainer.ppo.micro_batch_size
    out = {}
    for name, budget, packed in (
        ("fixed rows, padded", 0, False),
        ("by tokens, padded", cfg.update_token_budget, False),
        ("by tokens, packed", cfg.update_token_budget, True),
    ):
        plan = plan_update(rmask, mini, micro, 1, geometry=geo, token_budget=budget)
        fp = plan_footprint(plan, geo, packed=packed)
        out[name] = {
            "micro_batches": float(sum(len(m) for m in plan)),
            "computed": float(fp.computed),
            "real": float(fp.real),
            "padding_fraction": fp.padding_fraction,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/alfworld_7b.yaml")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    res = measure(cfg, args.rows, args.seed)
    print(
        f"{cfg.name}: {args.rows} rows, prompts <= {cfg.env.max_prompt_length}, responses <= "
        f"{cfg.generation.max_response_length}; mini-batch {cfg.trainer.ppo.mini_batch_size}, micro-batch "
        f"{cfg.trainer.ppo.micro_batch_size} rows or {cfg.update_token_budget:,} positions"
    )
    print("| plan | micro-batches | computed positions | real positions | padding fraction |")
    print("|---|---:|---:|---:|---:|")
    for name, r in res.items():
        print(
            f"| {name} | {r['micro_batches']:.0f} | {r['computed']:,.0f} | {r['real']:,.0f} | "
            f"{r['padding_fraction']:.3f} |"
        )


if __name__ == "__main__":
    main()

"""ALFWorld throughput: steps per second with 16 parallel episodes through the EnvManager.

    python bench/alfworld_throughput.py --episodes 16 --workers 2 --rounds 2
    python bench/alfworld_throughput.py --workers 4 --append bench/results/envs-DATE.md

Games: the embedded default (generated, expert-verified, cached; ``--pool`` games of the train split), or
the official data with ``--data-dir``. Policy: uniformly random admissible actions in well-formed responses
(``<think>`` + one ``<action>``), so every step reaches the engine; random play rarely wins, so episodes
run the full 50 steps. Time covers ``EnvManager.step`` only (parsing, worker round trip, the TextWorld
PDDL engine, prompt rendering); resets (game load + fast-downward translation) are timed separately.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

from alignopsd.engine.envs.manager import EnvManager


def run(episodes: int, group: int, workers: int, rounds: int, seed: int, pool: int, data_dir: str | None, plain: bool):
    rng = random.Random(seed)
    steps, wall, reset_wall = 0, 0.0, 0.0
    kw: dict = {"data_dir": data_dir} if data_dir else {}
    if plain:
        kw["fast_engine"] = False
    with EnvManager("alfworld", num_workers=workers, step_timeout=120.0, **kw) as mgr:
        tasks = mgr.task_source("train", n=None, seed=seed, pool_size=pool)
        mgr.reset(tasks[:1], 1, seed)  # warm-up: worker imports
        for r in range(rounds):
            sample = random.Random(seed + r).sample(tasks, episodes // group)
            t0 = time.perf_counter()
            _, infos = mgr.reset(sample, group, seed + r)
            reset_wall += time.perf_counter() - t0
            dones = [False] * len(infos)
            while not all(dones):
                resp = [
                    None if d else f"<think>explore</think><action>{rng.choice(i['admissible_actions'])}</action>"
                    for d, i in zip(dones, infos)
                ]
                n_active = sum(not d for d in dones)
                t0 = time.perf_counter()
                _, _, dones, infos = mgr.step(resp)
                wall += time.perf_counter() - t0
                steps += n_active
        m = mgr.metrics()
    return {
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall,
        "reset_s": reset_wall / rounds,
        "failed": m["failed_episodes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--group", type=int, default=1, help="siblings per task (episodes // group tasks)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=24, help="generated train games to sample from")
    ap.add_argument("--data-dir", default=None, help="official ALFWorld data root (json_2.1.1 inside)")
    ap.add_argument("--plain-engine", action="store_true", help="without the TextWorld speed-ups")
    ap.add_argument("--append", default=None, help="markdown file to append a table row to")
    args = ap.parse_args()
    res = run(
        args.episodes, args.group, args.workers, args.rounds, args.seed, args.pool, args.data_dir, args.plain_engine
    )
    shape = f"{args.episodes // args.group} tasks x {args.group}"
    label = "alfworld" + (f" (official, {shape}" if args.data_dir else f" (generated, {shape}")
    label += ", plain TextWorld)" if args.plain_engine else ")"
    row = (
        f"| {label} | {args.episodes} | {args.workers} | {res['steps']} | {res['wall_s']:.2f} | "
        f"{res['steps_per_s']:.1f} | {int(res['failed'])} | {os.cpu_count()} CPU, {platform.python_version()}; "
        f"reset of the batch {res['reset_s']:.1f} s |"
    )
    print(row)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(row + "\n")


if __name__ == "__main__":
    main()

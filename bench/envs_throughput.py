"""Environment throughput: steps per second with 16 parallel episodes through the EnvManager.

    python bench/envs_throughput.py --env webshop --episodes 16 --workers 2 --rounds 3
    python bench/envs_throughput.py --env search --append bench/results/envs-DATE.md

A scripted random policy produces well-formed responses (``<think>`` + one action) so every step reaches the
environment: WebShop searches the instruction's first words, then clicks uniformly among the admissible
elements; Search searches the question (or a random passage title) and answers at the last turn. Time covers
the manager's whole ``step`` (parsing, worker round trip, environment, prompt rendering), not the policy.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

from alignopsd.engine.envs.manager import EnvManager


def _webshop_response(rng: random.Random, info: dict) -> str:
    acts = info.get("admissible_actions") or []
    if "search[<your query>]" in acts:
        words = str(info.get("task", "shirt")).split()[2:8]
        return f"<think>search</think><action>search[{' '.join(words)}]</action>"
    return f"<think>browse</think><action>{rng.choice(acts) if acts else 'click[back to search]'}</action>"


def _search_response(rng: random.Random, info: dict) -> str:
    if info.get("step", 0) >= 3:
        return "<think>answer</think><answer>unknown</answer>"
    q = str(info.get("task", ""))
    words = q.split()
    query = " ".join(rng.sample(words, min(4, len(words)))) if rng.random() < 0.5 else q
    return f"<think>look it up</think><search>{query}</search>"


def run(env: str, episodes: int, workers: int, rounds: int, seed: int) -> dict[str, float]:
    kwargs = {}
    if env == "search":
        from alignopsd.engine.envs.search.retriever import ensure_retriever

        kwargs["retriever_url"] = ensure_retriever({"seed": seed})  # one shared server, started before workers
    policy = _webshop_response if env == "webshop" else _search_response
    rng = random.Random(seed)
    steps, wall = 0, 0.0
    with EnvManager(env, num_workers=workers, step_timeout=120.0, **kwargs) as mgr:
        tasks = mgr.task_source("test", episodes, seed)
        mgr.reset(tasks[:1], 1, seed)  # warm-up: worker imports, catalogue / index load
        for r in range(rounds):
            _, infos = mgr.reset(tasks, 1, seed + r)
            dones = [False] * len(infos)
            while not all(dones):
                resp = [None if d else policy(rng, i) for d, i in zip(dones, infos)]
                n_active = sum(not d for d in dones)
                t0 = time.perf_counter()
                _, _, dones, infos = mgr.step(resp)
                wall += time.perf_counter() - t0
                steps += n_active
        failed = mgr.metrics()["failed_episodes"]
    return {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=["webshop", "search"], required=True)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--append", default=None, help="markdown file to append a table row to")
    args = ap.parse_args()
    res = run(args.env, args.episodes, args.workers, args.rounds, args.seed)
    row = (
        f"| {args.env} | {args.episodes} | {args.workers} | {res['steps']} | {res['wall_s']:.2f} | "
        f"{res['steps_per_s']:.1f} | {int(res['failed'])} | {os.cpu_count()} CPU, {platform.python_version()} |"
    )
    print(row)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(row + "\n")


if __name__ == "__main__":
    main()

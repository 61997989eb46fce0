"""The update before and after micro-batches by tokens and padding-free rows: one RL step, alternated, profiled.

    python -m bench.update_ab --config runs/quickstart_cpu/config.yaml --warm <warm start> [--rounds 2]

Each round runs ``alignopsd profile --cost`` (``--steps 2 --warmup 1 --no-trace``: the second step measured) once
per variant, in the order A B (A B ...), on the same config and warm start, so both variants see the same machine
load over the session:

- ``before``: fixed-row micro-batches, padded rows (``trainer.ppo.max_token_len_per_gpu=0``,
  ``trainer.ppo.use_remove_padding=false``): the update as it was before issue 44;
- ``after``: the config's settings (micro-batches by tokens; padded or packed rows as the run measures on this
  CPU: a padding fraction of 0 in the update says it took packed rows).

Per run: the measured step and its update (s), the update's achieved GFLOP/s and its share of the device limit
(the cost table's "of the limit"), the padding fractions of the update and the old log-prob pass, the whole
command's seconds (startup probes included). The runs sample, so their steps differ from round to round. The recipe
(variants, steps, rounds) was fixed before the first result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.provenance import commit_line

VARIANTS = {
    "before": ["trainer.ppo.max_token_len_per_gpu=0", "trainer.ppo.use_remove_padding=false"],
    "after": [],
}


def _update_row(table: str) -> tuple[float, str]:
    """(GFLOP/s, share of the limit) of the PPO update in the cost table's work-and-efficiency rows."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "PPO update" and len(cells) >= 9:
            return float(cells[5].replace(",", "")), cells[8]
    raise ValueError("the cost table has no PPO update row")


def run_variant(name: str, args, work: Path, round_i: int) -> dict:
    out = work / f"{name}-{round_i}"
    cmd = [sys.executable, "-m", "alignopsd.engine", "profile", "--config", args.config, "--no-trace",
           "--estimators", "alignopsd", "--steps", "2", "--warmup", "1", "--cost",
           "--cost-out", str(out / "cost.md"), "--json", str(out / "summary.json"),
           "--set", f"model.name={args.warm}", "--set", f"output_dir={out}"]  # fmt: skip
    for s in [*VARIANTS[name], *args.set]:
        cmd += ["--set", s]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name} (round {round_i}) failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    gflops, share = _update_row((out / "cost.md").read_text())
    c = summary["counts"]
    return {
        "variant": name,
        "round": round_i,
        "load": load,
        "step": summary["step_seconds"],
        "update": summary["phases"]["update"],
        "old_logprob": summary["phases"]["old_logprob"],
        "gflops": gflops,
        "share": share,
        "pad": c.get("actor/padding_fraction", float("nan")),
        "pad_old": c.get("actor/padding_fraction_old_logprob", float("nan")),
        "wall": wall,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--warm", required=True, help="the warm start's model folder")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="extra overrides for both variants")
    args = ap.parse_args(argv)
    print(f"commit {commit_line()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, args.rounds + 1):
            for name in VARIANTS:
                row = run_variant(name, args, Path(tmp), r)
                rows.append(row)
                print(f"{name} round {r}: {row}", flush=True)
    print("\n| run | load at start | step s | update s | old log-prob s | update GFLOP/s | of the limit | "
          "padding (update) | padding (old log-prob) | command s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['variant']} ({x['round']}) | {x['load']:.2f} | {x['step']:.1f} | {x['update']:.1f} | "
              f"{x['old_logprob']:.1f} | {x['gflops']:.1f} | {x['share']} | {x['pad']:.3f} | {x['pad_old']:.3f} | "
              f"{x['wall']:.0f} |")  # fmt: skip
    print("\npadding (update) 0 in 'after': the run measured packed rows faster here and took them")


if __name__ == "__main__":
    main()

"""Held-out evaluation: ``alignopsd eval --config FILE [--checkpoint DIR] [--set k=v ...]``.

Plays the config's held-out split (``env.val_split``, ``env.val_tasks`` tasks, one episode each, at the
validation temperature) with the policy weights of a checkpoint (or the config's initial model), and prints
the result laid out like the paper's Table 1:

* ALFWorld: success per task category (Pick, Look, Clean, Heat, Cool, Pick2) and their average (All);
* WebShop: Score (mean task score x 100) and Acc (fraction of fully successful purchases x 100);
* Search-QA: exact-match accuracy per data source (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, Musique, Bamboogle)
  and the average;
* any other environment: its success rate and the success of each task category.

The columns are the environment's (``eval_columns`` of its registry entry, engine/envs/registry.py).
``--json FILE`` also writes ``{"env", "checkpoint", "episodes", "table": {column: value}, "metrics"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from alignopsd.engine.checkpoint.manifest import ManifestError, verify_manifest
from alignopsd.engine.checkpoint.trainer_state import STATE_FILE, read_trainer_state
from alignopsd.engine.checkpoint.weights import WEIGHTS_FILE, load_weights
from alignopsd.engine.commands.options import add_run_args
from alignopsd.engine.config.arch_check import check_architecture
from alignopsd.engine.config.preflight import preflight
from alignopsd.engine.config.schema import ConfigError, RunConfig, load_config
from alignopsd.engine.envs.registry import get_entry, resolve
from alignopsd.engine.infra.writes import WriteFailure, writing
from alignopsd.engine.infra.writes import report as report_write_failure


def table_values(env: str, metrics: dict[str, float]) -> dict[str, float | None]:
    """The evaluation table of ``env`` (percentages) from validation metrics: its registry entry's columns."""
    return resolve(get_entry(env).eval_columns)(metrics)


def format_table(env: str, values: dict[str, float | None], row: str = "policy") -> str:
    cols = list(values)
    head = "| Method | " + " | ".join(cols) + " |"
    sep = "|---|" + "---:|" * len(cols)
    cells = " | ".join("–" if values[c] is None else f"{values[c]:.1f}" for c in cols)
    return "\n".join([head, sep, f"| {row} | {cells} |"])


def evaluate(cfg: RunConfig, checkpoint: str | None = None) -> dict:
    """Run the held-out pass; returns {"env", "checkpoint", "episodes", "table", "metrics"}.

    Opens a session (the policy: the config's model, with the weights of ``checkpoint`` when given; a generator
    over it; the held-out games) and plays the held-out games (engine/run/heldout.py); it takes no lock on the run's
    output folder, so it may run beside the run's training."""
    from alignopsd.engine.run.heldout import heldout_metrics
    from alignopsd.engine.run.session import open_session

    session = open_session(cfg)
    try:
        if checkpoint:
            try:
                session.policy.load_hf_state_dict(load_weights(checkpoint))
            except ValueError as exc:
                raise ValueError(f"--checkpoint: {exc}") from None
        metrics = heldout_metrics(session)
    finally:
        session.close()
    return {
        "env": cfg.env.name,
        "checkpoint": checkpoint,
        "episodes": int(metrics.get("episode/count", 0)),
        "table": table_values(cfg.env.name, metrics),
        "metrics": metrics,
    }


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(prog="alignopsd eval", description="Evaluate a checkpoint on held-out tasks.")
    add_run_args(p)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the config's initial model)")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        preflight(cfg)
        if args.checkpoint:
            files = verify_manifest(Path(args.checkpoint), require=(WEIGHTS_FILE,))
            if STATE_FILE in files:  # a trainer's checkpoint: its state is checked like a resume checks it
                read_trainer_state(args.checkpoint)
            check_architecture(args.checkpoint, cfg.model.name, what="--checkpoint")  # before any model is built
    except (ConfigError, ManifestError) as exc:
        print(f"{'config' if isinstance(exc, ConfigError) else '--checkpoint'} error: {exc}", file=sys.stderr)
        return 2
    print(cfg.dtype_line(), flush=True)
    res = evaluate(cfg, args.checkpoint)
    name = Path(args.checkpoint).name if args.checkpoint else cfg.model.name
    print(f"{cfg.env.name} ({cfg.env.val_split}, {res['episodes']} episodes)")
    print(format_table(cfg.env.name, res["table"], row=name))
    if args.json:
        try:
            with writing(args.json):
                Path(args.json).write_text(json.dumps(res, indent=2, default=float))
        except WriteFailure as exc:
            return report_write_failure(exc, "alignopsd eval")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command-line options shared by the commands that read a run config."""

from __future__ import annotations

import argparse

__all__ = ["add_run_args"]


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (configs/*.yaml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set algorithm.estimator=grpo (repeatable)",
    )

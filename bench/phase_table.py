"""Two ``alignopsd profile --json`` summaries side by side, with the second over the first (markdown).

    python -m bench.phase_table A.json B.json --names "HF,Megatron TP=2"

The table is engine/observe/profiler.py's ``format_side_by_side`` (phase seconds and shares per run, the ratio column,
and the per-step counts the summaries carry).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from alignopsd.engine.observe.profiler import format_side_by_side


def load_summary(path: str) -> dict:
    """One single-estimator profile JSON (``phases``, ``step_seconds``, ...); a clear error names a wrong file."""
    data = json.loads(Path(path).read_text())
    missing = {"phases", "step_seconds", "overhead_vs_grpo"} - set(data)
    if missing:
        raise ValueError(f"{path}: not a single-estimator profile summary (missing {', '.join(sorted(missing))})")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.phase_table", description=__doc__.splitlines()[0])
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--names", default="first,second", help="comma-separated column names of the two runs")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.names.split(",")]
    if len(names) != 2 or not all(names):
        print(f"--names: two comma-separated names, got {args.names!r}", file=sys.stderr)
        return 2
    summaries = {names[0]: load_summary(args.first), names[1]: load_summary(args.second)}
    print(format_side_by_side(summaries, ratio=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

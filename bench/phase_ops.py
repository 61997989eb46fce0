"""Where one phase of a profiled step spends its time: the operators' self time inside the phase's range.

    python -m bench.phase_ops <trace.json> [--phase update] [--top 15]

The trace is the one ``alignopsd profile`` writes of its last step (torch.profiler's chrome trace; the engine's
profiler wraps every phase in a ``phase/<name>`` range). Every complete event on a thread that starts inside the
phase's range on that thread is placed in its thread's call tree (events nest by time); an event's self time is its
duration less its children's, so the rows add up to the threads' time inside the phase and nothing is counted twice.
Printed: per operator name, self milliseconds, share of the phase, calls; then the phase's wall time.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _complete_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]


def phase_ops(trace: dict, phase: str) -> tuple[float, dict[str, tuple[float, int]]]:
    """(the phase's wall microseconds, {operator: (self microseconds, calls)}) of ``phase`` in a chrome trace; the
    phase's own range event is left out (its self time is time in no operator: "(outside operators)")."""
    events = _complete_events(trace)
    ranges = [e for e in events if e["name"] == f"phase/{phase}"]
    if not ranges:
        names = sorted({e["name"][6:] for e in events if e["name"].startswith("phase/")})
        raise ValueError(f"phase {phase!r}: not in the trace (phases: {', '.join(names) or 'none'})")
    wall = sum(float(r["dur"]) for r in ranges)
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for r in ranges:
        lo, hi = float(r["ts"]), float(r["ts"]) + float(r["dur"])
        inside = [e for e in events if e.get("tid") == r.get("tid") and e.get("pid") == r.get("pid")]
        inside = [e for e in inside if lo <= float(e["ts"]) < hi and e is not r]
        inside.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        child_time: dict[int, float] = defaultdict(float)
        stack: list[tuple[int, float]] = []  # (index, end)
        top = 0.0
        for i, e in enumerate(inside):
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and ts >= stack[-1][1]:
                stack.pop()
            if stack:
                child_time[stack[-1][0]] += dur
            else:
                top += dur
            stack.append((i, ts + dur))
        for i, e in enumerate(inside):
            row = out[e["name"]]
            row[0] += float(e["dur"]) - child_time[i]
            row[1] += 1
        outside = out["(outside operators)"]
        outside[0] += float(r["dur"]) - top
    return wall, {k: (v[0], int(v[1])) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--phase", default="update")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    wall, ops = phase_ops(json.loads(args.trace.read_text()), args.phase)
    print("| operator | self ms | of the phase | calls |\n|---|---:|---:|---:|")
    for name, (us, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| `{name}` | {us / 1e3:,.1f} | {us / wall:.1%} | {calls} |")
    print(f"\nphase {args.phase}: {wall / 1e3:,.1f} ms (the main thread's range)")


if __name__ == "__main__":
    main()

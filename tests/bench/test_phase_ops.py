"""bench/phase_ops.py: operators' self time inside one phase of a chrome trace, nested by time."""

from __future__ import annotations

import pytest

from bench.phase_ops import phase_ops


def _ev(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_self_time_subtracts_children_and_stays_inside_the_phase():
    trace = {
        "traceEvents": [
            _ev("phase/update", 100, 100),
            _ev("aten::linear", 110, 40),  # children: addmm 30 -> self 10
            _ev("aten::addmm", 115, 30),
            _ev("aten::mul", 160, 10),
            _ev("aten::mm", 170, 5, tid=2),  # another thread: not the phase's
            _ev("aten::mm", 250, 5),  # after the phase
            _ev("phase/rollout", 0, 90),
            {"ph": "i", "name": "marker", "ts": 120},
        ]
    }
    wall, ops = phase_ops(trace, "update")
    assert wall == 100
    assert ops["aten::linear"] == (10, 1) and ops["aten::addmm"] == (30, 1) and ops["aten::mul"] == (10, 1)
    assert ops["(outside operators)"] == (50, 0) and "aten::mm" not in ops
    assert sum(us for us, _ in ops.values()) == pytest.approx(wall)
    with pytest.raises(ValueError, match=r"phase 'x': not in the trace \(phases: rollout, update\)"):
        phase_ops(trace, "x")

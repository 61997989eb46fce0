"""bench/fault_cost.py: the lost time of a fault and its parts, from a run's timestamps (parsing only, nothing run)."""

from __future__ import annotations

import pytest

from bench.fault_cost import breakdown


def _rec(step: int, end: float, wall: float, rss: float = 1.0) -> dict:
    return {"kind": "train", "step": step, "wall_time": end, "time/step_wall": wall, "memory/peak_rss_gib": rss}


def test_a_kill_costs_the_restart_and_the_repeated_part_of_the_step():
    # step 2 began at 100 (step 1's checkpoint), the kill at 104; the new worker at 105, its attempt record at 109,
    # the dtype line at 110, "resumed" at 113, and the repeated step 2 ran 114 -> 124 (10 s)
    metrics = [_rec(1, 99.0, 9.0), _rec(2, 124.0, 10.0, rss=2.5), _rec(3, 134.0, 10.0)]
    got = breakdown(104.0, 100.0, metrics, [50.0, 109.0], 105.0, 110.0, 113.0, 1)
    assert got["parts_s"] == {
        "agent_restarts_worker": 1.0,
        "process_start_and_imports": 4.0,
        "preflight_and_checkpoint_verify": 1.0,
        "model_build_and_checkpoint_load": 3.0,
        "setup_before_step": 1.0,
        "repeated_partial_step": 4.0,
    }
    assert got["lost_s"] == 14.0 and got["brief_formula_s"] == 10.0 and got["peak_rss_gib"] == 2.5


def test_a_preemption_costs_the_exit_and_the_relaunch_not_the_finished_step():
    # SIGTERM at 104 in step 2, which ends at 110 (saved); the agent exits at 112, the relaunch's worker starts at
    # 113, its attempt at 117, dtype at 118, resumed at 121, step 3 runs 122 -> 132
    metrics = [_rec(1, 99.0, 9.0), _rec(2, 110.0, 10.0), _rec(3, 132.0, 10.0)]
    got = breakdown(104.0, 100.0, metrics, [50.0, 117.0], 113.0, 118.0, 121.0, 2, relaunch=112.0)
    assert got["step_in_flight_finished_s"] == 6.0 and got["parts_s"]["checkpoint_and_exit"] == 2.0
    assert got["parts_s"]["relaunch_to_worker_start"] == 1.0 and got["lost_s"] == 12.0
    assert got["brief_formula_s"] == 18.0  # the finished step 2 counted in: why the lost time is reported apart


def test_a_step_logged_twice_is_refused():
    metrics = [_rec(1, 99.0, 9.0), _rec(2, 124.0, 10.0), _rec(2, 125.0, 10.0)]
    with pytest.raises(ValueError, match="each once"):
        breakdown(104.0, 100.0, metrics, [109.0], 105.0, 110.0, 113.0, 1)


def test_a_preemption_past_its_grace_costs_the_wait_and_the_step_run_again():
    # SIGTERM at 104 in step 2 (began at 100); the grace runs out, the run exits at 124 unsaved and is launched again;
    # worker 125, attempt 129, dtype 130, resumed from step 1 at 133, step 2 runs again 134 -> 144
    metrics = [_rec(1, 99.0, 9.0), _rec(2, 144.0, 10.0), _rec(3, 154.0, 10.0)]
    got = breakdown(104.0, 100.0, metrics, [50.0, 129.0], 125.0, 130.0, 133.0, 1, relaunch=124.0)
    assert got["parts_s"]["wait_for_exit"] == 20.0 and got["parts_s"]["repeated_partial_step"] == 4.0
    assert got["lost_s"] == 34.0 and "step_in_flight_finished_s" not in got

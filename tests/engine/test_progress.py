"""Time-left estimates on the progress lines of the long stages (RL steps, SFT steps, rollout turns)."""

from __future__ import annotations

import io
import logging
import time

from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.generation.base import SamplingParams
from alignopsd.engine.observe.metrics import MetricsLogger
from alignopsd.engine.observe.progress import format_seconds, time_left
from alignopsd.engine.step.rollout import collect_rollouts

from tests.engine.test_rollout import ScriptedGenerator, codeword_player, tok  # noqa: F401 (fixture)


def test_format_and_extrapolation():
    assert [format_seconds(s) for s in (0, 42.4, 185, 3720)] == ["0s", "42s", "3m05s", "1h02m"]
    assert time_left(30.0, 1, 4) == "~1m30s left"  # 30 s per unit, 3 units to go
    assert time_left(30.0, 2, 4, bound=True) == "<=30s left"
    assert time_left(0.0, 0, 4) == "" and time_left(10.0, 4, 4) == "" and time_left(float("nan"), 1, 4) == ""


def test_step_lines_carry_the_time_left_of_this_process(tmp_path, monkeypatch):
    clock = iter([100.0, 160.0, 220.0, 280.0])  # logger start, then one step a minute
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    lg = MetricsLogger(tmp_path, total_steps=5, stream=out)
    for step in (3, 4, 5):  # a resumed run: the first step this process logs is step 3 of 5
        lg.log(step, {"time/step": 60.0})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("| ~2m00s left"), lines[0]  # 1 step in 60 s, 2 to go
    assert lines[1].endswith("| ~1m00s left"), lines[1]
    assert "left" not in lines[2]


def test_rollout_turn_lines_carry_an_upper_bound(tok, caplog):  # noqa: F811 (fixture)
    env = EnvManager("codeword", num_workers=0)
    gen = ScriptedGenerator(tok, codeword_player)
    with caplog.at_level(logging.INFO, logger="alignopsd.engine.step.rollout"):
        collect_rollouts(env, gen, tok, env.task_source("train", n=1, seed=0), group_n=2,
                         sampling=SamplingParams(max_new_tokens=64), max_prompt_length=400, seed=0)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout turn")]
    assert len(lines) == 4  # the codeword episodes last 4 turns
    assert all(", <=" in line and line.endswith(" left") for line in lines[:-1]), lines
    assert "left" not in lines[-1]  # every episode ended: nothing is left

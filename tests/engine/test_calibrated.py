"""Phase times from calibrated rates (engine/lab/calibrated.py), the calibration on the run's own code paths
(engine/lab/calibration.py) and the quickstart pipeline's estimate (engine/lab/estimate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.lab.calibrated import PhaseRates, fit_step, part_time, predict_phases
from alignopsd.engine.lab.cost_model import Part, PhaseWork
from alignopsd.engine.lab.estimate import (
    ENV_SECONDS_PER_TURN,
    EXPERT_SECONDS_PER_GAME,
    SAVE_SECONDS,
    SETUP_SECONDS,
    estimate_pipeline,
    format_estimate,
)
from alignopsd.engine.models.shapes import resolve_shape

ROOT = Path(__file__).resolve().parents[2]


def _rates(**kw) -> PhaseRates:
    base = dict(device="cpu", dtype="float32", threads=2, prefill_flops=1e9, step_s=0.05, decode_flops=2e8,
                score_flops=1e9, forcing_flops=5e8, train_flops=4e8, optimizer_s=0.5,
                probes={"load": 2.0})  # fmt: skip
    return PhaseRates(**{**base, **kw})


def test_fit_step_recovers_the_fixed_cost_and_the_rate():
    pts = [(x, 0.05 + x / 2e8) for x in (1e6, 4e6, 8e6, 2e7)]
    a, rate = fit_step(pts)
    assert a == pytest.approx(0.05) and rate == pytest.approx(2e8)
    a, rate = fit_step([(1e6, 0.1), (2e6, 0.1)])  # no growth: all fixed
    assert a == pytest.approx(0.1) and rate == float("inf")
    a, rate = fit_step([(1e6, 0.001), (2e6, 0.01)])  # a negative intercept: through the origin
    assert a == 0.0 and rate > 0
    with pytest.raises(ValueError, match="need >= 2"):
        fit_step([(1.0, 1.0)])


def test_each_part_is_timed_at_its_own_rate():
    r = _rates()
    assert part_time(Part("decode", flops=2e8, rows=4, tokens=40, steps=10), "rollout_generation", r) == (
        pytest.approx(10 * 0.05 + 1.0)
    )
    assert part_time(Part("prefill", flops=3e9), "teacher_generation", r) == pytest.approx(3.0)
    fwd = Part("forward", flops=1e9)
    assert part_time(fwd, "old_logprob", r) == pytest.approx(1.0)
    assert part_time(fwd, "teacher_forcing", r) == pytest.approx(2.0)  # the cached path's own rate
    assert part_time(Part("forward+backward", flops=4e8), "update", r) == pytest.approx(1.0)
    assert part_time(Part("optimizer", bytes=1e9, steps=3), "update", r) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no calibrated rate"):
        part_time(Part("other", flops=1.0), "x", r)
    w = {"update": PhaseWork("update", [Part("forward+backward", flops=4e8), Part("optimizer", steps=2)])}
    assert predict_phases(w, r) == {"update": pytest.approx(2.0)}


def _quickstart(overrides=()):
    return load_config(str(ROOT / "configs" / "quickstart_cpu.yaml"), list(overrides))


def _stages(cfg, r, steps=60, batch=4, games=0):
    return {s.name: s.seconds for s in estimate_pipeline(cfg, resolve_shape("smollm2-135m"), r, steps=steps,
                                                         batch=batch, games=games)}  # fmt: skip


def test_the_estimate_follows_the_config_and_the_pipeline_parameters():
    r = _rates()
    base = _stages(_quickstart(), r)
    assert list(base) == ["games", "eval base", "warm start", "eval warm start", "RL steps (3)", "eval RL"]
    assert base["games"] == 0 and all(v > 0 for k, v in base.items() if k != "games")
    assert _stages(_quickstart(), r, games=48)["games"] > 0
    half = _stages(_quickstart(), r, steps=30)
    # what does not scale with the steps (the policy it trains was loaded for the base evaluation)
    load_play = 32 * EXPERT_SECONDS_PER_GAME + SAVE_SECONDS
    assert half["warm start"] - load_play == pytest.approx((base["warm start"] - load_play) / 2)
    fewer = _stages(_quickstart(["env.val_tasks=8"]), r)
    assert fewer["eval base"] < base["eval base"] and fewer["warm start"] == base["warm start"]
    shorter = _stages(_quickstart(["generation.max_response_length=32"]), r)
    assert shorter["eval base"] < base["eval base"] and shorter["RL steps (3)"] < base["RL steps (3)"]
    more = _stages(_quickstart(["trainer.total_steps=6"]), r)
    fixed = r.probes["load"] + SETUP_SECONDS + SAVE_SECONDS
    assert more["RL steps (6)"] - fixed == pytest.approx(2 * (base["RL steps (3)"] - fixed))
    slower = _stages(_quickstart(), _rates(step_s=0.1, decode_flops=1e8, prefill_flops=5e8))
    fixed += 16 * 8 * ENV_SECONDS_PER_TURN - SAVE_SECONDS  # no save; the base model plays all 8 turns of the 16 games
    assert slower["eval base"] - fixed == pytest.approx(2 * (base["eval base"] - fixed))
    text = format_estimate(estimate_pipeline(_quickstart(), resolve_shape("smollm2-135m"), r, steps=60, batch=4,
                                             games=0), r)  # fmt: skip
    assert text.splitlines()[0].startswith("[estimate] the whole run: ~") and "warm start: ~" in text


def test_calibration_runs_the_engines_paths_and_gives_usable_rates(monkeypatch):
    from alignopsd.engine.lab.calibration import DECODE_PROBES, calibrate_phases
    from alignopsd.engine.step.rescoring import Rescorer

    scored = []  # (rows, mode) of each old log-prob probe: the run's rescorer on one micro-batch
    real = Rescorer.student_logprobs

    def spy(self, batch, **kw):
        scored.append((batch.size, self.mode, kw.get("with_entropy")))
        return real(self, batch, **kw)

    monkeypatch.setattr(Rescorer, "student_logprobs", spy)
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), ["trainer.ppo.micro_batch_size=3"])
    r = calibrate_phases(cfg, torch.device("cpu"))
    assert scored and set(scored) == {(3, cfg.trainer.rescoring_mode, True)}
    for k in ("prefill_flops", "score_flops", "forcing_flops", "train_flops"):
        assert 0 < getattr(r, k) < 1e15, k
    assert r.decode_flops > 0  # inf where a step's time does not grow with its rows (a tiny model: all fixed cost)
    assert r.step_s + 1e6 / r.decode_flops > 0
    assert r.step_s >= 0 and r.optimizer_s > 0 and r.probes["load"] > 0 and r.dtype == "float32"
    probes = {"prefill", "teacher forcing", "scoring forward rows=3", "forward+backward", "optimizer step"}
    assert probes <= set(r.probes)
    assert sum(k.startswith("decode step") for k in r.probes) == len(DECODE_PROBES)
    assert "teacher forcing" in r.probes  # hf keeps the prompt's keys and values: the cached forcing is timed


def test_calibration_times_the_int8_sampler_the_run_builds():
    """With generation.quantize int8 the run samples from an int8 copy that keeps no prompt cache: the calibration
    times that generator, and the teacher forcing (which then scores again) at the scoring rate."""
    from alignopsd.engine.lab.calibration import calibrate_phases

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), ["generation.quantize=int8"])
    r = calibrate_phases(cfg, torch.device("cpu"))
    assert "teacher forcing" not in r.probes and r.forcing_flops == r.score_flops


def test_sft_estimate_prints_the_profile_and_the_stages(capsys):
    from alignopsd.engine.commands.cli import main

    rc = main(["sft", "--config", str(ROOT / "configs" / "tiny.yaml"), "--estimate"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    prof = next(ln for ln in lines if ln.startswith("[profile] "))
    assert f"kernels {torch.backends.cpu.get_cpu_capability()}" in prof and "model.dtype auto -> float32" in prof
    assert "no native bf16" in prof  # the test suite forces no CPU flags (tests/conftest.py)
    assert any(ln.startswith("[estimate] the whole run: ~") for ln in lines)
    assert any("eval base: ~" in ln for ln in lines) and any("warm start: ~" in ln for ln in lines)

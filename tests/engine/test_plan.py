"""``alignopsd plan``: the per-phase plan of a paper profile at full scale, and its bad-input exits."""

from __future__ import annotations

from pathlib import Path

import pytest
from alignopsd.engine.commands import cli
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.lab.step_plan import QUICKSTART_MEANS, layout, plan_counts

ROOT = Path(__file__).resolve().parents[2]
CFG = str(ROOT / "configs" / "alfworld_7b.yaml")


def _value(out: str, prefix: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith(prefix))
    return float(line.split("|")[-3].strip().strip("*").replace(",", ""))


@pytest.mark.parametrize("gpu", ["a800", "h200"])
def test_plan_of_the_paper_profile(gpu, capsys):
    assert cli.main(["plan", "--config", CFG, "--gpu", gpu, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert f"on 8 x {gpu.upper()} (tensor parallel 2, data parallel 4)" in out
    assert "qwen2.5-7b, 7.62B weights (published shape of qwen2.5-7b (no local folder" in out
    for phase in ("rollout generation", "old log-prob", "reference log-prob", "teacher generation *",
                  "teacher forcing *", "PPO update"):  # fmt: skip
        assert f"| {phase} | " in out
    assert "GPU-hours" in out and "alignment overhead" in out and "tokens/s/GPU" in out
    assert "| published | 92.8 | 1,581 |" in out and "| this model | " in out
    step = _value(out, "| **step** |")
    assert step > 0


def test_plan_is_faster_on_h200_and_teacher_work_scales_with_its_budget(capsys):
    cli.main(["plan", "--config", CFG, "--gpu", "a800", "--world-size", "8"])
    a800 = _value(capsys.readouterr().out, "| **step** |")
    cli.main(["plan", "--config", CFG, "--gpu", "h200", "--world-size", "8"])
    h200 = _value(capsys.readouterr().out, "| **step** |")
    assert h200 < a800  # more FLOP/s and more bandwidth
    cfg = load_config(CFG)
    c1, _ = plan_counts(cfg, layout(cfg, 8))
    c2, notes = plan_counts(load_config(CFG, ["env.teacher_max_response_length=1024"]), layout(cfg, 8))
    assert c2.teacher_tokens == pytest.approx(c1.teacher_tokens / 2)
    assert c1.rows == 16 * 8 / 4 * 50 * QUICKSTART_MEANS["turns_mean"] / QUICKSTART_MEANS["max_turns"]
    assert any("scores the 0.62 distinct teacher prompts" in n for n in notes)  # vLLM: prompts scored again


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpu", "v100", "--world-size", "8"], "--gpu: unknown GPU 'v100'; allowed: a800, a100, h100, h200"),
        (["--gpu", "a800", "--world-size", "0"], "--world-size: 0 does not divide into policy.tensor_parallel_size 2"),
        (["--gpu", "a800", "--world-size", "3"], "--world-size: 3 does not divide into policy.tensor_parallel_size 2"),
        (["--gpu", "a800", "--world-size", "12"],
         "env.tasks_per_step: 16 tasks per step do not split evenly over 6 data-parallel groups "
         "(--world-size 12 / policy.tensor_parallel_size 2); allowed: a multiple of 6"),
        (["--gpu", "a800", "--world-size", "8", "--set", "model.name=org/Mystery-9B"],
         "model.name: cannot size 'org/Mystery-9B'"),
        (["--gpu", "a800", "--world-size", "8", "--compute-fraction", "0"],
         "--compute-fraction: 0.0 is outside (0, 1]"),
    ],
)  # fmt: skip
def test_plan_bad_input_exits_2_with_one_line(args, message, capsys):
    assert cli.main(["plan", "--config", CFG, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_padded_rows_cost_what_their_positions_cost(capsys):
    """The Megatron backend pads its plain rows: the plan's scoring and update forwards compute the padded positions
    (the update's own plan over the synthetic batch) and say what padding-free rows would save; a Hugging Face
    policy on CUDA with ``use_remove_padding`` auto computes none, and ``false`` pads again."""
    from dataclasses import replace

    from alignopsd.engine.lab.cost_model import step_work
    from alignopsd.engine.lab.padding_plan import planned_counts
    from alignopsd.engine.models.shapes import resolve_shape

    cli.main(["plan", "--config", CFG, "--gpu", "a800", "--world-size", "8"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("padding: "))
    frac = float(line.split("%")[0].removeprefix("padding: ")) / 100
    assert 0.2 < frac < 0.6 and "PPO update" in line and "rollout generation" not in line
    assert "rows padded (policy.backend megatron" in out
    cfg = load_config(CFG)
    counts, _ = planned_counts(cfg, layout(cfg, 8))
    assert plan_counts(cfg, layout(cfg, 8))[0] == replace(counts, padding_fraction=0.0)  # only the share added
    assert counts.padding_fraction == pytest.approx(frac, abs=5e-4)
    shape = resolve_shape(cfg.model.name)
    padded = step_work(shape, counts, dtype_bytes=2, kv_bytes=2, train_parallel=2)
    free = step_work(shape, replace(counts, padding_fraction=0.0), dtype_bytes=2, kv_bytes=2, train_parallel=2)
    pos = {k: sum(p.tokens for p in padded[k].parts if not p.decode) for k in ("update", "reference")}
    pos0 = {k: sum(p.tokens for p in free[k].parts if not p.decode) for k in ("update", "reference")}
    for k in pos:
        assert pos[k] * (1 - counts.padding_fraction) == pytest.approx(pos0[k])  # real positions over computed
    assert padded["rollout_generation"].flops == free["rollout_generation"].flops  # generation never pads rows
    hf = ["--set", "policy.backend=hf", "--set", "policy.tensor_parallel_size=1"]
    cli.main(["plan", "--config", CFG, "--gpu", "a800", "--world-size", "8", *hf])
    assert "padding: none (padding-free rows)" in capsys.readouterr().out
    cli.main(
        [
            "plan",
            "--config",
            CFG,
            "--gpu",
            "a800",
            "--world-size",
            "8",
            *hf,
            "--set",
            "trainer.ppo.use_remove_padding=false",
        ]
    )
    assert "rows padded (policy.backend hf, trainer.ppo.use_remove_padding False)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"padding_fraction: 1.0 is outside \[0, 1\)"):
        step_work(shape, replace(counts, padding_fraction=1.0), dtype_bytes=2, kv_bytes=2)


def test_shared_prompt_prefixes_recost_the_update(capsys):
    """The plan's update pushes the profile's measured share of shared prompt prefixes once only where the update
    shares them (a Hugging Face policy on the CPU; never on the plan's GPUs), and says what pushing them once would
    cost: the update's positions are its rows' real ones less that share (a packed prefix tree pads nothing)."""
    from dataclasses import replace

    from alignopsd.engine.lab.cost_model import step_work
    from alignopsd.engine.lab.padding_plan import planned_counts
    from alignopsd.engine.lab.step_plan import SHARED_PREFIX_MEASURED, update_shared_fraction
    from alignopsd.engine.models.shapes import resolve_shape

    cli.main(["plan", "--config", CFG, "--gpu", "a800", "--world-size", "8"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("shared prompt prefixes: "))
    measured = SHARED_PREFIX_MEASURED["alfworld_7b"]
    assert f"{measured:.1%} of the update's row positions" in line and "not pushed once here" in line
    cfg = load_config(CFG)
    counts, _ = planned_counts(cfg, layout(cfg, 8))
    assert counts.update_shared == 0.0 and update_shared_fraction(cfg) == (0.0, measured)
    shape = resolve_shape(cfg.model.name)
    plain = step_work(shape, counts, dtype_bytes=2, kv_bytes=2, train_parallel=2)["update"].parts[0]
    shared = step_work(shape, replace(counts, update_shared=measured), dtype_bytes=2, kv_bytes=2, train_parallel=2)
    real = counts.train_rows * (counts.prompt_mean + counts.response_mean)
    assert shared["update"].parts[0].tokens == pytest.approx(real * (1 - measured))
    assert shared["update"].parts[0].tokens < plain.tokens and shared["update"].flops < plain.flops
    hf_set = ["policy.backend=hf", "policy.tensor_parallel_size=1"]
    hf = load_config(CFG, hf_set)
    assert update_shared_fraction(hf, "cpu") == (measured, measured) and update_shared_fraction(hf)[0] == 0.0
    padded = load_config(CFG, [*hf_set, "trainer.ppo.use_remove_padding=false"])
    assert update_shared_fraction(padded, "cpu")[0] == 0.0
    assert update_shared_fraction(load_config(CFG, ["name=other"]), "cpu") == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"update_shared: 1.0 is outside \[0, 1\)"):
        step_work(shape, replace(counts, update_shared=1.0), dtype_bytes=2, kv_bytes=2)

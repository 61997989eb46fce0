"""The cost model (engine/observe): model shapes, the work of each phase, device limits, the efficiency table."""

from __future__ import annotations

import json

import pytest
import torch
from alignopsd.engine.lab.cost_model import Part, StepCounts, step_work
from alignopsd.engine.lab.device_limits import DeviceLimits, calibrate, gpu_limits, part_seconds, phase_seconds
from alignopsd.engine.lab.efficiency import counts_from_summary, format_efficiency
from alignopsd.engine.models.shapes import ModelShape, resolve_shape, shape_from_hf_config


@pytest.mark.parametrize(
    "name,params",  # totals on the model cards
    [("Qwen/Qwen2.5-7B-Instruct", 7.62e9), ("Qwen/Qwen2.5-3B-Instruct", 3.09e9),
     ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9), ("smollm2-135m", 134.5e6)],
)  # fmt: skip
def test_published_shapes_give_the_published_weight_counts(name, params):
    s = resolve_shape(name)
    assert s.params == pytest.approx(params, rel=0.005)
    assert "model folder absent" in s.source


def test_a_model_folder_config_wins_and_an_unknown_name_is_refused(tmp_path):
    cfg = {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 200, "vocab_size": 1000, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = resolve_shape(str(tmp_path))
    assert (s.hidden, s.layers, s.kv_heads, s.dim, s.source) == (96, 3, 2, 24, "config.json of the model folder")
    with pytest.raises(ValueError, match=r"cannot size 'org/NoSuchModel-1B'.*known: smollm2-135m"):
        resolve_shape("org/NoSuchModel-1B")
    tiny = resolve_shape("tiny-bpe")  # an embedded test model: its built folder's config.json
    assert (tiny.hidden, tiny.layers, tiny.dim) == (64, 2, 32) and tiny.source == "the engine's embedded test model"
    with pytest.raises(ValueError, match="has no intermediate_size"):
        shape_from_hf_config({k: v for k, v in cfg.items() if k != "intermediate_size"}, "x", "test")


def test_flop_formulas_match_a_counted_forward():
    """Linear, head and attention FLOPs of the shape equal torch's FLOP counter on a real (eager) Llama forward."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(hf).eval()
    model.config._attn_implementation = "eager"  # plain matmuls over the full [T, T] scores
    s = shape_from_hf_config(hf.to_dict(), "t", "test")
    B, T = 3, 17
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=torch.randint(0, 300, (B, T)))
    expected = s.linear_flops(B * T) + s.attention_flops(B * T, T) + s.head_flops(B * T)
    assert fc.get_total_flops() == pytest.approx(expected, rel=1e-9)


def _shape() -> ModelShape:
    return ModelShape("m", hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=50, tied_head=True)


def test_decoding_reads_the_weights_once_per_step_and_each_rows_context():
    s = _shape()
    c = StepCounts(rows=8, rows_per_call=4, prompt_mean=10, response_mean=6, rollout_prefill=40, train_rows=8)
    w = step_work(s, c, dtype_bytes=2, kv_bytes=4)
    pre, dec = w["rollout_generation"].parts
    assert pre.label == "prefill" and pre.tokens == 40
    assert pre.flops == s.linear_flops(40) + s.attention_flops(40, 5) + s.head_flops(2)  # 2 calls: 2 last positions
    tokens, steps = 8 * 6, 8 * 6 / 4
    assert dec.tokens == tokens and dec.rows == 4
    assert dec.bytes == steps * s.weight_bytes(2) + tokens * (10 + 3) * s.kv_bytes_per_position(4)
    up = w["update"].parts
    assert up[0].flops == 3 * w["old_logprob"].flops  # forward + backward
    assert up[1].bytes == 32 * s.params  # one optimizer step
    assert "teacher_generation" not in w and "reference" not in w
    c2 = StepCounts(**{**c.__dict__, "recompute": True, "reference": True, "teacher_rows": 8, "teacher_tokens": 16,
                       "teacher_prompt_mean": 20, "teacher_prefill": 100, "forcing_rows": 24, "forcing_positions": 144,
                       "forcing_context": 23})  # fmt: skip
    w2 = step_work(s, c2, dtype_bytes=2, kv_bytes=4, train_parallel=2)
    assert w2["update"].parts[0].flops == 4 * w2["old_logprob"].flops and w2["update"].parts[0].parallel == 2
    assert w2["reference"].flops == w2["old_logprob"].flops
    assert w2["teacher_generation"].decoded_tokens == 16 and w2["teacher_forcing"].parts[0].tokens == 144
    # the old log-prob pass pushes shared prompt prefixes once: its measured positions replace rows x (p + r)
    w3 = step_work(s, StepCounts(**{**c.__dict__, "scoring_positions": 70}), dtype_bytes=2, kv_bytes=4)
    olp = w3["old_logprob"].parts[0]
    assert olp.tokens == 70 and olp.flops == s.linear_flops(70) + s.attention_flops(70, 8) + s.head_flops(48)
    assert w3["update"].flops == w["update"].flops  # the update still trains every row's positions


def test_roofline_time_of_parts_and_the_gemm_rate_by_rows():
    lim = DeviceLimits("d", {1: 1e9, 4: 3e9, 64: 10e9, 256: 8e9}, 2e9, "test")
    assert lim.flops_at(0) == 10e9 and lim.flops_at(4) == 3e9 and lim.flops_at(100) == 10e9
    assert lim.flops_at(300) == 10e9 and lim.flops_at(0.5) == 1e9  # best at M <= rows; below all: the smallest
    dec = Part("decode", flops=6e9, bytes=1e9, rows=4)
    assert part_seconds(dec, lim) == pytest.approx(2.0)  # FLOPs at M=4 (2 s) over bytes (0.5 s)
    assert part_seconds(Part("decode", flops=1e9, bytes=8e9, rows=64), lim) == pytest.approx(4.0)
    fwd = Part("forward", flops=20e9, parallel=2)
    assert part_seconds(fwd, lim, compute_fraction=0.5) == pytest.approx(2.0)
    assert part_seconds(Part("optimizer", bytes=4e9), lim, bandwidth_fraction=0.5) == pytest.approx(4.0)


def test_gpu_table_and_calibration():
    a = gpu_limits("a800")
    assert a.peak_flops == 312e12 and a.bytes_per_s == 2039e9 and "A100 datasheet" in a.source
    assert gpu_limits("NVIDIA H200").bytes_per_s == 4800e9 and gpu_limits("h100").peak_flops == 989e12
    with pytest.raises(ValueError, match=r"--gpu: unknown GPU 'v100'; allowed: a800, a100, h100, h200"):
        gpu_limits("v100")
    lim = calibrate(32, 64, torch.float32, rows=(1, 8), bandwidth_bytes=1 << 20, min_time=0.0, max_reps=3)
    assert set(lim.flops) == {1, 8} and all(v > 0 for v in lim.flops.values()) and lim.bytes_per_s > 0
    assert lim.threads == torch.get_num_threads() and lim.dtype == "float32"
    assert "GEMMs [M, 32] x [32, 64] and its transpose" in lim.source and "gemm M=8 K=64" in lim.probes


@pytest.mark.parametrize(("kernel_runs", "gemm_runs"), [(True, False), (False, False), (False, True)])
def test_bf16_cpu_limit_is_the_fastest_gemm_the_engine_has(monkeypatch, kernel_runs, gemm_runs):
    """bf16 on a CPU: the limit is the best of torch's GEMMs (AMX where present), the C++ bf16 kernel and the head's
    bf16 GEMM with fp32 results where they run (times injected: torch's GEMMs 1 s each, the engine's own 1 ms)."""
    from alignopsd.engine.lab import device_limits as dl
    from alignopsd.kernels import cpp
    from alignopsd.kernels.head import bf16_gemm, cpu_partials

    seen = []

    def injected(fn, device, min_time, max_reps):
        fn()
        seen.append(len(seen))
        return 1e-3 if (kernel_runs or gemm_runs) and len(seen) == 5 else 1.0  # 4 torch GEMMs, the engine's, the read

    monkeypatch.setattr(dl, "_best", injected)
    monkeypatch.setattr(cpp, "native_ready", lambda: kernel_runs)
    monkeypatch.setattr(cpu_partials, "native_partials", lambda h, w, t, inv_t, v0, need_u=True: None)
    monkeypatch.setattr(bf16_gemm, "gemm_ready", lambda: gemm_runs)
    monkeypatch.setattr(bf16_gemm, "mm_bf16", lambda a, b, out: None)
    lim = calibrate(32, 64, torch.bfloat16, rows=(1, 8), bandwidth_bytes=1 << 20)
    assert len(seen) == 5 + kernel_runs + gemm_runs
    torch_rate = 2.0 * 8 * 32 * 64 / 1.0
    assert lim.flops[8] == (2.0 * 8 * 32 * 64 / 1e-3 if kernel_runs or gemm_runs else torch_rate)
    assert ("native head M=8 K=32" in lim.probes) is kernel_runs
    assert ("and the C++ bf16 kernel" in lim.source) is kernel_runs
    assert ("bf16 gemm fp32 out M=8 K=32" in lim.probes) is gemm_runs
    assert ("and the bf16 GEMM with fp32 results" in lim.source) is gemm_runs


def _summary(phases: dict, counts: dict) -> dict:
    full = {k: 0.0 for k in ("rollout_generation", "old_logprob", "teacher_generation", "teacher_forcing", "update")}
    full.update(phases)
    align = full["teacher_generation"] + full["teacher_forcing"]
    step = sum(full.values())
    return {"phases": full, "step_seconds": step, "alignment_seconds": align,
            "overhead_vs_grpo": align / (step - align),
            "steps": 1, "counts": counts}  # fmt: skip


COUNTS = {"batch/rows": 8, "batch/turns": 8, "rollout/prompt_length_mean": 10, "rollout/response_length_mean": 6,
          "rollout/prefill_token_forwards": 40, "m1/teacher_prefill_token_forwards": 100,
          "m1/teacher_prefill_token_forwards_unshared": 160, "m1/teacher_tokens_generated": 16,
          "m1/teacher_response_length_mean": 2, "m1/teacher_forcing_row_count": 24,
          "m1/teacher_forcing_token_forwards": 144, "m1/teacher_forcing_cached_prompts": 4}  # fmt: skip


def test_counts_from_a_profile_summary():
    c = counts_from_summary(COUNTS, group_n=4, tasks_per_step=1, mini_batch=64, reference=False, recompute=False)
    assert (c.rows, c.rows_per_call, c.train_rows, c.teacher_rows) == (8, 4, 8, 8)
    assert c.teacher_prompt_mean == 20 and c.forcing_context == 20 + 3  # cached prompts: responses over the prompt
    assert c.optimizer_steps == 1 and c.scoring_positions == 0  # not measured: every row's positions
    assert counts_from_summary({**COUNTS, "actor/old_logprob_token_forwards": 90}, group_n=4, tasks_per_step=1,
                               mini_batch=64, reference=False, recompute=False).scoring_positions == 90  # fmt: skip
    with pytest.raises(ValueError, match="missing batch/turns"):
        counts_from_summary({"batch/rows": 1}, group_n=1, tasks_per_step=1, mini_batch=1, reference=False,
                            recompute=False)  # fmt: skip


def test_efficiency_table_overhead_floor_resemblance_and_prediction():
    s = _shape()
    c = counts_from_summary(COUNTS, group_n=4, tasks_per_step=1, mini_batch=64, reference=False, recompute=False)
    w = step_work(s, c, dtype_bytes=2, kv_bytes=4)
    lim = DeviceLimits("cpu", {1: 1e6, 4: 1e6, 1024: 1e7}, 1e8, "test")
    floor = {k: phase_seconds(v, lim) for k, v in w.items()}
    # measured: the GRPO phases at their floor (100 %), teacher generation at 2x (50 %), teacher forcing at 1.1x
    meas = {**floor, "teacher_generation": 2 * floor["teacher_generation"],
            "teacher_forcing": 1.1 * floor["teacher_forcing"]}  # fmt: skip
    summ = _summary(meas, COUNTS)
    text = format_efficiency(summ, w, lim, "t")
    lines = text.splitlines()
    assert "| teacher generation | 50.0% | rollout generation | 100.0% | 0.50 | not met |" in lines
    assert "| teacher forcing | 90.9% | old log-prob | 100.0% | 0.91 | met |" in lines
    fl = (floor["teacher_generation"] + floor["teacher_forcing"]) / (floor["rollout_generation"] + floor["old_logprob"]
                                                                     + floor["update"])  # fmt: skip
    assert f"floor {100 * fl:.1f}%" in text and f"measured {100 * summ['overhead_vs_grpo']:.1f}%" in text
    pred = [ln for ln in text.splitlines() if ln.startswith("| teacher generation | ")][-1]
    assert "| 0.50 | no |" in pred or "(under 5% of the step)" in pred
    assert [ln for ln in text.splitlines() if ln.startswith("| PPO update | ")][-1].endswith("| 1.00 | yes |")


@pytest.mark.slow
def test_profile_cost_prints_and_writes_the_efficiency_and_prediction_tables(tmp_path, capsys):
    """`alignopsd profile --cost --cost-out`: the path a real profile takes, on the tiny run."""
    from pathlib import Path

    from alignopsd.engine.commands import cli

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
    sets = ["--set", f"output_dir={tmp_path}", "--set", "env.max_turns=1", "--set", "generation.max_response_length=8",
            "--set", "env.teacher_max_response_length=8", "--set", "algorithm.kl_coef=0.0"]  # fmt: skip
    md = tmp_path / "cost.md"
    rc = cli.main(["profile", "--config", tiny, *sets, "--steps", "1", "--estimators", "alignopsd", "--no-trace",
                   "--cost", "--cost-out", str(md)])  # fmt: skip
    assert rc == 0
    out, text = capsys.readouterr().out, md.read_text()
    for t in (out, text):
        assert "work and efficiency**" in t and "| teacher forcing | " in t and "limits: " in t
        assert "| phase | measured s | share | predicted s | predicted / measured | within +-30% |" in t
        assert "alignment overhead: measured " in t and "floor " in t
    assert text.startswith("command: `alignopsd profile --config") and "load average (1, 5, 15 min)" in text
    assert "| **step** |" in text  # the phase table itself, so the file is the whole result

"""``alignopsd plan``: what one step of a config costs at full scale, phase by phase, from the roofline.

    alignopsd plan --config configs/alfworld_7b.yaml --gpu a800 --world-size 8 [--set k=v ...]
                   [--compute-fraction 0.5] [--bandwidth-fraction 0.8]

The model's shapes come from its folder's ``config.json``, or from the published-shape table when the folder is
absent (said in the output; engine/models/shapes.py). The step's counts are the config's batch with the
quickstart's measured means where the config has only maxima (engine/lab/step_plan.py; each assumption is
printed). Per phase: FLOPs, bytes read, decoded tokens and a time: compute-bound work at ``--compute-fraction`` of
the GPU's dense bf16 peak, decoding at ``max(FLOPs at that fraction, bytes / (--bandwidth-fraction x HBM
bandwidth))`` (engine/lab/cost_model.py, device_limits.py: the model the profiler's efficiency table uses).
Then the GRPO step (the same step without the alignment phases), the alignment overhead, tokens/s/GPU (training
tokens / step time / GPUs, NeMo-RL's definition) and the GPU-hours of ``trainer.total_steps``; and NeMo-RL's
published GRPO measurement beside the same model evaluated at its setting.

Not modelled (no time): environment steps, the thinking encoder, selection/credit arithmetic, weight sync.
Bad input (unknown GPU, a world size that does not divide into the config's parallel layout, a model it cannot
size, a fraction outside (0, 1]) exits 2 with one line naming the value and what is allowed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from alignopsd.engine.lab.cost_model import PhaseWork, step_work
from alignopsd.engine.lab.device_limits import DeviceLimits, gpu_limits, phase_seconds
from alignopsd.engine.observe.profiler import ALIGNMENT_PHASES, PHASES, phase_label

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig


def plan_times(work: dict[str, PhaseWork], lim: DeviceLimits, cf: float, bf: float) -> dict[str, float]:
    return {k: phase_seconds(w, lim, cf, bf) for k, w in work.items()}


def summary(work, times: dict[str, float], *, world: int, tokens: float, total_steps: int) -> dict[str, float]:
    """Step seconds, GRPO step, overhead, tokens/s/GPU and GPU-hours of a plan (``tokens``: training tokens per
    step over all groups)."""
    step = sum(times.values())
    align = sum(times.get(k, 0.0) for k in ALIGNMENT_PHASES)
    grpo = step - align
    return {
        "step": step,
        "grpo_step": grpo,
        "overhead": align / grpo if grpo > 0 else float("inf"),
        "tokens_per_s_gpu": tokens / step / world if step > 0 else 0.0,
        "gpu_hours": step * total_steps * world / 3600.0,
    }


def format_phases(work: dict[str, PhaseWork], times: dict[str, float]) -> list[str]:
    step = sum(times.values())
    lines = [
        "| phase | GFLOP | GB read | decoded tokens | bound | s/step | share |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for k in PHASES:
        if k not in work:
            continue
        w, t = work[k], times[k]
        bound = "bytes (decode)" if w.decode_bound else "FLOPs"
        lines.append(
            f"| {phase_label(k, mark=True)} | {w.flops / 1e9:,.0f} | {w.bytes / 1e9:,.0f} | {w.decoded_tokens:,.0f} | "
            f"{bound} | {t:,.1f} | {100 * t / step:.1f}% |"
        )
    lines.append(f"| **step** | | | | | **{step:,.1f}** | 100% |")
    return lines


def padding_line(fraction: float, times: dict[str, float], free: dict[str, float]) -> str:
    """What the padded positions cost: the step against the same step in padding-free rows."""
    if fraction <= 0.0:
        return "padding: none (padding-free rows)"
    saved = sum(times.values()) - sum(free.values())
    parts = ", ".join(
        f"{phase_label(k, mark=True)} {times[k]:,.1f} -> {free[k]:,.1f} s"
        for k in PHASES
        if k in times and times[k] != free[k]
    )
    return (
        f"padding: {fraction:.1%} of the scoring and update positions; in padding-free rows {parts}: the step "
        f"{sum(free.values()):,.1f} s ({saved:,.1f} s, {saved / sum(times.values()):.1%} less)"
    )


def run_plan(cfg: RunConfig, gpu: str, world_size: int, cf: float, bf: float) -> str:
    """The plan's text (ValueError naming a bad GPU, world size or model)."""
    from alignopsd.engine.lab.padding_plan import planned_counts
    from alignopsd.engine.lab.step_plan import NEMO_RL_REFERENCE, layout
    from alignopsd.engine.models.shapes import resolve_shape

    lim = gpu_limits(gpu)
    lay = layout(cfg, world_size)
    shape = resolve_shape(cfg.model.name)
    counts, notes = planned_counts(cfg, lay)
    kw = {"dtype_bytes": 2, "kv_bytes": 2, "train_parallel": lay.tensor_parallel}
    work = step_work(shape, counts, **kw)
    times = plan_times(work, lim, cf, bf)
    tokens = counts.train_rows * (counts.prompt_mean + counts.response_mean) * lay.data_parallel
    s = summary(work, times, world=world_size, tokens=tokens, total_steps=cfg.trainer.total_steps)
    free = plan_times(step_work(shape, replace(counts, padding_fraction=0.0), **kw), lim, cf, bf)
    out = [
        f"plan: {cfg.name} on {world_size} x {lim.name} (tensor parallel {lay.tensor_parallel}, "
        f"data parallel {lay.data_parallel}); bf16 weights and keys/values",
        f"model: {shape.name}, {shape.params / 1e9:.2f}B weights ({shape.source})",
        f"limits: {lim.bytes_per_s / 1e12:.2f} TB/s, {lim.peak_flops / 1e12:.0f} TFLOP/s ({lim.source}); "
        f"compute at {cf:.0%} of peak, bandwidth at {bf:.0%}",
        "",
        "one step, per data-parallel group (* alignment phases; no time for environment, encoder, weight sync):",
        "",
        *format_phases(work, times),
        "",
        f"GRPO step (without the alignment phases) {s['grpo_step']:,.1f} s; AlignOPSD step {s['step']:,.1f} s; "
        f"alignment overhead {100 * s['overhead']:.1f}% ({1 + s['overhead']:.2f}x)",
        f"training tokens/s/GPU {s['tokens_per_s_gpu']:,.0f} ({tokens:,.0f} tokens per step); "
        f"{cfg.trainer.total_steps} steps: {s['step'] * cfg.trainer.total_steps / 3600:,.1f} h, "
        f"{s['gpu_hours']:,.0f} GPU-hours",
        padding_line(counts.padding_fraction, times, free),
        "",
        "assumptions:",
        *[f"- {n}" for n in notes],
        "",
    ]
    ref = NEMO_RL_REFERENCE
    rshape = resolve_shape(ref.model)
    rlim = gpu_limits(ref.gpu)
    rwork = step_work(rshape, ref.counts, dtype_bytes=2, kv_bytes=2)
    rtimes = plan_times(rwork, rlim, cf, bf)
    rtok = ref.counts.train_rows * (ref.counts.prompt_mean + ref.counts.response_mean) * ref.world_size
    rs = summary(rwork, rtimes, world=ref.world_size, tokens=rtok, total_steps=1)
    out += [
        f"reference: {ref.label}, {rshape.name} on {ref.world_size} x {rlim.name}, evaluated by the same model "
        "at the same fractions:",
        "",
        *format_phases(rwork, rtimes),
        "",
        "| | step s | tokens/s/GPU |",
        "|---|---:|---:|",
        f"| published | {ref.step_seconds:.1f} | {ref.tokens_per_s_gpu:,.0f} |",
        f"| this model | {rs['step']:.1f} | {rs['tokens_per_s_gpu']:,.0f} |",
        f"| published / model | {ref.step_seconds / rs['step']:.2f} | "
        f"{ref.tokens_per_s_gpu / rs['tokens_per_s_gpu']:.2f} |",
        "",
        *[f"- {n}" for n in ref.notes],
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.commands.options import add_run_args
    from alignopsd.engine.config.schema import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="alignopsd plan", description="Per-phase cost of a step at full scale.")
    add_run_args(ap)
    ap.add_argument("--gpu", required=True, help="a800 | a100 | h100 | h200 | l40s")
    ap.add_argument("--world-size", type=int, required=True, help="devices in all (a multiple of tensor parallel)")
    ap.add_argument("--compute-fraction", type=float, default=0.5, help="of the dense bf16 peak (default 0.5)")
    ap.add_argument("--bandwidth-fraction", type=float, default=0.8, help="of the HBM bandwidth (default 0.8)")
    args = ap.parse_args(argv)
    for name, v in (("--compute-fraction", args.compute_fraction), ("--bandwidth-fraction", args.bandwidth_fraction)):
        if not 0 < v <= 1:
            print(f"alignopsd plan: {name}: {v} is outside (0, 1]", file=sys.stderr)
            return 2
    try:
        cfg = load_config(args.config, list(args.overrides or []))
        text = run_plan(cfg, args.gpu, args.world_size, args.compute_fraction, args.bandwidth_fraction)
    except (ConfigError, ValueError) as exc:
        print(f"alignopsd plan: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

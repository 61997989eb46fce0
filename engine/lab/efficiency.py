"""The efficiency table of ``alignopsd profile --cost``: per phase, the measured seconds beside the work the phase
must do (engine/lab/cost_model.py) and the time that work needs at the device's limits
(engine/lab/device_limits.py).

From a profile summary (its ``counts``: rows, lengths, prefill positions, teacher tokens, teacher-forced positions,
all measured in the step) :func:`counts_from_summary` builds the step's :class:`StepCounts`; per phase the table
gives FLOPs, bytes read by decoding and the optimizer, decoded tokens, achieved GFLOP/s and GB/s, the floor (the
roofline time at the limits) and the efficiency ``floor / measured`` (the fraction of the limit reached). Then:

- the alignment overhead two ways: measured (alignment seconds over the rest of the step) and floor (the
  alignment phases' floor over the floor of the rest: what the method's extra work costs at the device's limits);
- each alignment phase's efficiency against the GRPO phase it resembles (teacher generation / rollout
  generation, teacher forcing / old log-prob), goal >= 80 %;
- the prediction check: each phase's work at the rates the run's own code paths reached in a short calibration
  (engine/lab/calibrated.py; the floor when no such rates are given) against the measured seconds, for every phase
  over 5 % of the step, goal within +-30 %.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignopsd.engine.lab.calibrated import STEPS_PER_RESPONSE, PhaseRates, predict_phases
from alignopsd.engine.lab.cost_model import PhaseWork, StepCounts, step_work
from alignopsd.engine.lab.device_limits import DeviceLimits, phase_seconds
from alignopsd.engine.models.shapes import ModelShape
from alignopsd.engine.observe.profiler import ALIGNMENT_PHASES, phase_label

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig
RESEMBLES = {"teacher_generation": "rollout_generation", "teacher_forcing": "old_logprob"}
EFFICIENCY_GOAL = 0.8  # an alignment phase's efficiency over its GRPO counterpart's
PREDICTION_BAND = 0.3  # predicted within +-30 % of measured ...
PREDICTION_SHARE = 0.05  # ... for every phase over 5 % of the step


def counts_from_summary(
    counts: dict,
    *,
    group_n: int,
    tasks_per_step: int,
    world_size: int = 1,
    mini_batch: int,
    reference: bool,
    recompute: bool,
) -> StepCounts:
    """The step's :class:`StepCounts` from a profile summary's ``counts`` (means per step, one rank)."""
    need = ("batch/rows", "batch/turns", "rollout/prompt_length_mean", "rollout/response_length_mean")
    missing = [k for k in need if k not in counts]
    if missing:
        raise ValueError(f"profile counts: missing {', '.join(missing)}")
    rows, turns = counts["batch/rows"], counts["batch/turns"]
    p, r = counts["rollout/prompt_length_mean"], counts["rollout/response_length_mean"]
    teacher = counts.get("m1/teacher_tokens_generated", 0.0) > 0
    # the teacher prompts' mean length: one padded batch per chunk is the unshared count (an upper bound)
    tp = counts.get("m1/teacher_prefill_token_forwards_unshared", 0.0) / turns if teacher and turns else 0.0
    tr = counts.get("m1/teacher_response_length_mean", 0.0)
    cached = counts.get("m1/teacher_forcing_cached_prompts", 0.0) > 0
    per_call = group_n * tasks_per_step / world_size
    r_max = counts.get("rollout/response_length_max", r)
    return StepCounts(
        rows=rows,
        rows_per_call=per_call,
        prompt_mean=p,
        response_mean=r,
        rollout_prefill=counts.get("rollout/prefill_token_forwards", rows * p),
        train_rows=turns,
        teacher_rows=turns if teacher else 0.0,
        teacher_prompt_mean=tp,
        teacher_prefill=counts.get("m1/teacher_prefill_token_forwards", turns * tp) if teacher else 0.0,
        teacher_tokens=counts.get("m1/teacher_tokens_generated", 0.0),
        forcing_rows=counts.get("m1/teacher_forcing_row_count", 0.0),
        forcing_positions=counts.get("m1/teacher_forcing_token_forwards", 0.0),
        forcing_context=tp + r / 2 if cached else (tp + max(r, tr)) / 2,
        reference=reference,
        optimizer_steps=max(1.0, -(-turns * world_size // mini_batch)),
        recompute=recompute,
        # decoding steps: a batch decodes until its longest row ends (the step's longest row bounds it)
        rollout_steps=rows / max(per_call, 1.0) * min(r_max, STEPS_PER_RESPONSE * r),
        teacher_steps=STEPS_PER_RESPONSE * tr,
        scoring_positions=counts.get("actor/old_logprob_token_forwards", 0.0),
    )


def efficiency_rows(summary: dict, work: dict[str, PhaseWork], lim: DeviceLimits) -> list[dict]:
    """One row per phase with model work: seconds, FLOPs, bytes, decoded tokens, floor, efficiency."""
    rows = []
    for k, w in work.items():
        secs = float(summary["phases"].get(k, 0.0))
        floor = phase_seconds(w, lim)
        rows.append(
            {
                "phase": k,
                "seconds": secs,
                "flops": w.flops,
                "bytes": w.bytes,
                "decoded": w.decoded_tokens,
                "decode_bound": w.decode_bound,
                "floor": floor,
                "efficiency": floor / secs if secs > 0 else 0.0,
            }
        )
    return rows


def _g(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def format_efficiency(
    summary: dict, work: dict[str, PhaseWork], lim: DeviceLimits, title: str, rates: PhaseRates | None = None
) -> str:
    """Markdown: the efficiency table, the overhead measured and at the floor, the resemblance and prediction
    checks (see the module doc)."""
    rows = efficiency_rows(summary, work, lim)
    step = summary["step_seconds"]
    out = [
        f"**{title}: work and efficiency**",
        "",
        "| phase | s/step | GFLOP | GB read | decoded tokens | GFLOP/s | GB/s | floor s | of the limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["seconds"]
        rate = f"{r['flops'] / s / 1e9:,.1f}" if s > 0 else "–"
        bw = f"{r['bytes'] / s / 1e9:,.2f}" if s > 0 and r["bytes"] else "–"
        mark = " (decode-bound)" if r["decode_bound"] else ""
        out.append(
            f"| {phase_label(r['phase'])}{mark} | {s:.3f} | {_g(r['flops'])} | {_g(r['bytes'])} | "
            f"{r['decoded']:,.0f} | {rate} | {bw} | {r['floor']:.3f} | "
            f"{100 * r['efficiency']:.1f}% |"
        )
    out += ["", f"limits: {lim.describe()}"]
    by = {r["phase"]: r for r in rows}
    align_floor = sum(by[k]["floor"] for k in ALIGNMENT_PHASES if k in by)
    if align_floor > 0:
        rest_floor = sum(r["floor"] for r in rows if r["phase"] not in ALIGNMENT_PHASES)
        out.append(
            f"alignment overhead: measured {100 * summary['overhead_vs_grpo']:.1f}% "
            f"(alignment phases {summary['alignment_seconds']:.3f} s over the rest "
            f"{step - summary['alignment_seconds']:.3f} s); "
            f"floor {100 * align_floor / rest_floor:.1f}% (their floor {align_floor:.3f} s over the modelled rest's "
            f"{rest_floor:.3f} s; environment, encoder and bookkeeping have no floor)"
        )
        out += [
            "",
            "| alignment phase | efficiency | GRPO phase it resembles | efficiency | ratio | goal >= 80% |",
            "|---|---:|---|---:|---:|---|",
        ]
        for a, g in RESEMBLES.items():
            if a in by and g in by and by[g]["efficiency"] > 0:
                ratio = by[a]["efficiency"] / by[g]["efficiency"]
                out.append(
                    f"| {phase_label(a)} | {100 * by[a]['efficiency']:.1f}% | {phase_label(g)} | "
                    f"{100 * by[g]['efficiency']:.1f}% | {ratio:.2f} | "
                    f"{'met' if ratio >= EFFICIENCY_GOAL else 'not met'} |"
                )
    predicted = predict_phases(work, rates) if rates is not None else {r["phase"]: r["floor"] for r in rows}
    how = f"calibrated rates: {rates.describe()}" if rates is not None else "the floor at the limits"
    out += ["", f"prediction: {how}", "", format_prediction(summary, rows, predicted)]
    return "\n".join(out)


def format_prediction(summary: dict, rows: list[dict], predicted: dict[str, float]) -> str:
    """Predicted against measured seconds, per phase with model work."""
    step = summary["step_seconds"]
    out = [
        "| phase | measured s | share | predicted s | predicted / measured | within +-30% |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        s = r["seconds"]
        share = s / step if step > 0 else 0.0
        pred = predicted[r["phase"]]
        ratio = pred / s if s > 0 else float("inf")
        if share > PREDICTION_SHARE:
            verdict = "yes" if abs(ratio - 1) <= PREDICTION_BAND else "no"
        else:
            verdict = "(under 5% of the step)"
        out.append(
            f"| {phase_label(r['phase'])} | {s:.3f} | {100 * share:.1f}% | {pred:.3f} | {ratio:.2f} | {verdict} |"
        )
    return "\n".join(out)


def profile_cost(
    summary: dict,
    cfg: RunConfig,
    shape: ModelShape,
    lim: DeviceLimits,
    *,
    dtype_bytes: float,
    kv_bytes: float,
    world_size: int = 1,
    title: str = "",
    rates: PhaseRates | None = None,
) -> str:
    """The efficiency section of one profiled estimator (``summary`` from engine/run/profiler.summarize)."""
    c = counts_from_summary(
        summary.get("counts", {}),
        group_n=cfg.env.group_n,
        tasks_per_step=cfg.env.tasks_per_step,
        world_size=world_size,
        mini_batch=cfg.trainer.ppo.mini_batch_size,
        reference=summary["phases"].get("reference", 0.0) > 0,
        recompute=bool(cfg.policy.gradient_checkpointing),
    )
    work = step_work(shape, c, dtype_bytes=dtype_bytes, kv_bytes=kv_bytes)
    return format_efficiency(summary, work, lim, title or cfg.name, rates)


def device_limits_for(cfg: RunConfig, shape: ModelShape, device) -> tuple[DeviceLimits, list[str]]:
    """The limits the efficiency table uses on ``device`` and notes: on CPU the calibration (the model's MLP GEMM
    and a read probe in its dtype, the run's threads); on CUDA the vendor peak of the GPU's name, with the same
    probes printed beside it."""
    from alignopsd.engine.lab.device_limits import calibrate, gpu_limits
    from alignopsd.engine.parallel.hardware import choose_dtype

    dtype = choose_dtype(cfg.model.dtype, device).dtype
    measured = calibrate(shape.hidden, shape.intermediate, dtype, device=device)
    if getattr(device, "type", str(device)) != "cuda":
        return measured, []
    try:
        peak = gpu_limits(measured.name)
    except ValueError:
        return measured, [f"no vendor peak for {measured.name!r}: the probes are the limits"]
    return peak, [f"probes on this GPU: {measured.describe()}"]


def cost_report(
    summaries: dict[str, dict], cfg: RunConfig, device, *, world_size: int = 1, rates: PhaseRates | None = None
) -> str:
    """The efficiency section of every profiled estimator, against one calibration of ``device``'s limits;
    ``rates`` (engine/lab/calibration.py) make the prediction (else the floor is)."""
    from alignopsd.engine.models.shapes import resolve_shape
    from alignopsd.engine.parallel.hardware import choose_dtype

    shape = resolve_shape(cfg.model.name)
    dtype = choose_dtype(cfg.model.dtype, device).dtype
    esize = 4 if str(dtype) == "torch.float32" else 2
    on_cpu = getattr(device, "type", str(device)) == "cpu"
    kv = 4 if on_cpu and cfg.generation.backend == "hf" else esize  # the CPU decoding cache keeps fp32 keys/values
    lim, notes = device_limits_for(cfg, shape, device)
    head = [
        f"model: {shape.name}, {shape.params / 1e6:,.0f}M weights ({shape.source}); weights {esize} bytes, "
        f"keys/values {kv} bytes per element"
    ] + notes
    parts = [
        profile_cost(
            s,
            cfg,
            shape,
            lim,
            dtype_bytes=esize,
            kv_bytes=kv,
            world_size=world_size,
            title=f"{cfg.name}: {est}",
            rates=rates,
        )
        for est, s in summaries.items()
    ]
    return "\n\n".join(["\n".join(head), *parts])


def provenance(argv: list[str] | None, load_start: tuple[float, float, float]) -> str:
    """Header of a written table: the command, commit, CPU, torch threads, date and the load at start and end."""
    import datetime
    import os
    import subprocess
    import sys

    import torch
    from alignopsd.engine.lab.device_limits import cpu_name

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in load_start)
    end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join(
        [
            f"command: `alignopsd profile {' '.join(args)}`",
            f"commit {commit}; {now}; CPU {cpu_name()} ({os.cpu_count()} logical CPUs), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; load average (1, 5, 15 min) {load} at the start, {end} at the end",
        ]
    )

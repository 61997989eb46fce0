"""The teacher pass of one real step: teacher forcing behind the teacher generation's kept prompts against scoring
the privileged prompts again (time, token forwards, and how far apart the log-probs are).

    python -m bench.bench_teacher_cache --config configs/quickstart_cpu.yaml \\
        --set model.name=<warm start> --set env.data_dir=<easy games> [--fp32-reference] [--profile]

Runs step 1's rollout and its teacher pass (``engine.step.teacher_pass.mechanism1``, the path a training step
takes); the rescorer's teacher forcing is wrapped so that, after the cached call the step makes, the same rows are
scored again without the cache (``Rescorer.teacher_logprobs`` with no ``prompt_cache``). Prints both times and
token forwards and the max / mean |delta| of the diagonal and cross log-probs over the response tokens. In fp32
(``--set model.dtype=float32``) the two agree to float rounding; in bf16 they differ by bf16 rounding, and
``--fp32-reference`` scores the same rows with an fp32 copy of the model to show how far each is from fp32.
``--profile``: torch.profiler's top operators of the teacher generation and of the cached teacher forcing (the
profiler slows both: read the times of a run without it).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def _diff(a, b, mask) -> tuple[float, float]:
    d = (a - b).abs()[mask]
    return (float(d.max()), float(d.mean())) if d.numel() else (0.0, 0.0)


def _profiled(fn, top: int):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)
    return out


def run(config: str, overrides: list[str], *, profile: bool, fp32_reference: bool) -> dict:
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.trainer import Trainer
    from alignopsd.engine.step.episodes import rollout_phase, step_seed, tasks_for_step
    from alignopsd.engine.step.rescoring import Rescorer
    from alignopsd.engine.step.teacher_pass import mechanism1

    from alignopsd.canonical import canonicalize

    cfg = load_config(config, ["trainer.ppo.skip_no_signal=false", *overrides])
    parts = Trainer(cfg, lock_output=False).parts
    rescorer, generator = parts.rescorer, parts.generator
    seen: dict = {}
    cached_call, generate = rescorer.teacher_logprobs, generator.generate

    def teacher_logprobs(cb, pairs=None, **kw):
        t0 = time.perf_counter()
        call = lambda: cached_call(cb, pairs, **kw)  # noqa: E731
        out = _profiled(call, 15) if profile and kw.get("prompt_cache") is not None else call()
        t1 = time.perf_counter()
        again = cached_call(cb, pairs)
        seen.update(cb=cb, pairs=pairs, cached=out, again=again, t_cached=t1 - t0, t_again=time.perf_counter() - t1)
        return out

    def generate_traced(prompts, sampling, **kw):
        call = lambda: generate(prompts, sampling, **kw)  # noqa: E731
        if not kw.get("keep_prompt_cache"):
            return call()  # the rollout
        t0 = time.perf_counter()
        out = _profiled(call, 15) if profile else call()
        seen["t_generation"] = time.perf_counter() - t0
        return out

    rescorer.teacher_logprobs = teacher_logprobs
    generator.generate = generate_traced
    try:
        parts.get_encoder()
        tasks = tasks_for_step(parts.train_tasks, 0, cfg.env.tasks_per_step, cfg.trainer.seed, 0, 1)
        batch, _ = rollout_phase(
            parts, tasks, seed=step_seed(cfg.trainer.seed, 0, 0), validation=False, teacher_prompts=True
        )
        canon = canonicalize(batch.task.tolist(), batch.rollout.tolist(), batch.turn.tolist())
        cb = batch.select(canon.first_row)
        _, metrics = mechanism1(parts, cb)
        if fp32_reference:
            ref_model = copy.deepcopy(parts.policy.hf_model).float()
            ref = Rescorer(ref_model, temperature=cfg.generation.temperature).teacher_logprobs(cb, seen["pairs"])
    finally:
        parts.close()
    (d1, c1, s1), (d0, c0, s0) = seen["cached"], seen["again"]
    mask = cb.response_mask.bool()
    pmask = cb.response_mask[seen["pairs"][:, 1]].bool() if seen["pairs"] is not None else mask[:0]
    res = {
        "dtype": str(next(parts.policy.hf_model.parameters()).dtype),
        "rows": int(s1["rows"]),
        "cached_prompts": int(s1.get("cached_prompts", 0)),
        "teacher_generation_s": round(seen.get("t_generation", float("nan")), 3),
        "teacher_forcing_cached_s": round(seen["t_cached"], 3),
        "teacher_forcing_again_s": round(seen["t_again"], 3),
        "token_forwards_cached": int(s1["token_forwards"]),
        "token_forwards_again": int(s0["token_forwards"]),
        "teacher_prefill_token_forwards": metrics.get("m1/teacher_prefill_token_forwards"),
        "diag_max_mean_delta": _diff(d1, d0, mask),
        "cross_max_mean_delta": _diff(c1, c0, pmask),
    }
    if fp32_reference:
        for name, (d, c) in (("cached", (d1, c1)), ("again", (d0, c0))):
            res[f"{name}_vs_fp32_diag_max_mean"] = _diff(d, ref[0], mask)
            res[f"{name}_vs_fp32_cross_max_mean"] = _diff(c, ref[1], pmask)
    return res


def main(argv: list[str] | None = None) -> None:
    from alignopsd.engine.commands.options import add_run_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap)
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of both phases")
    ap.add_argument("--fp32-reference", action="store_true", help="also score the rows with an fp32 copy of the model")
    args = ap.parse_args(argv)
    res = run(args.config, args.overrides, profile=args.profile, fp32_reference=args.fp32_reference)
    for k, v in res.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()

"""The engine part of the GPU check: real training steps of the tiny run on the device, one per estimator.

For every estimator of the registry and every AlignOPSD ablation (A-E): ``configs/tiny.yaml`` with the
self-contained tiny models (``model.name=tiny-bpe``: random Llama with a built-in BPE tokenizer;
``encoder.name=tiny-encoder``: random 2-layer BERT through the thinking encoder), the HF policy backend and
the HF generator, ``trainer.ppo.skip_no_signal=false`` (every phase runs), ``steps`` training steps. Checked:
no exception; every phase the estimator declares ran (time > 0 in every step); a finite loss; at least one
optimizer step; the policy weights changed. Each case's per-phase table (engine/observe/profiler.py) follows its
verdict. Then :func:`run_scale`: one AlignOPSD step at a quickstart-like batch (8 tasks x 8 rollouts, longer
responses, bf16 with fp32 masters on CUDA) with its table and the alignment overhead over GRPO.

The dry run (CPU) routes the algorithm core to the Triton kernels under the interpreter, as CUDA tensors are
routed on a GPU. Every line goes through ``emit`` as soon as it is known (the caller flushes it to the results
file), so a run cut off by a timeout keeps the cases it finished.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alignopsd.estimators import EstimatorPhases

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"

BASE = [
    "model.name=tiny-bpe",
    "encoder.name=tiny-encoder",
    "policy.backend=hf",
    "generation.backend=hf",
    "trainer.ppo.skip_no_signal=false",
    "trainer.logging.report=false",
    "trainer.logging.loggers=[jsonl]",
]
# CPU dry run: the same code on a smaller batch (1 task x 2 rollouts, 2 turns, short responses)
DRY = [
    "env.group_n=2",
    "env.tasks_per_step=1",
    "env.max_turns=2",
    "generation.max_response_length=8",
    "env.teacher_max_response_length=8",
]
# quickstart-like batch: 8 tasks x 8 rollouts, 4 turns, 64-token responses; bf16 on CUDA (fp32 masters)
SCALE = [
    "algorithm.estimator=alignopsd",
    "env.group_n=8",
    "env.tasks_per_step=8",
    "env.num_games=16",
    "generation.max_response_length=64",
    "env.teacher_max_response_length=64",
    "trainer.ppo.mini_batch_size=256",
    "trainer.ppo.micro_batch_size=64",
    "trainer.optimizer.lr=1e-3",
    "model.dtype=auto",
]
DRY_SCALE = ["env.group_n=4", "env.tasks_per_step=2", "env.max_turns=2", "generation.max_response_length=16",
             "env.teacher_max_response_length=16", "trainer.ppo.micro_batch_size=16"]  # fmt: skip


def engine_cases() -> list[tuple[str, list[str]]]:
    """(case name, overrides): every registered estimator, AlignOPSD once per ablation of §3.11."""
    from alignopsd.config import ABLATIONS
    from alignopsd.estimators import ESTIMATORS

    cases = [(n, [f"algorithm.estimator={n}"]) for n in ESTIMATORS if n != "alignopsd"]
    cases += [(f"alignopsd_{ab}", ["algorithm.estimator=alignopsd", f"algorithm.ablation={ab}"]) for ab in ABLATIONS]
    return cases


def expected_phases(declared: EstimatorPhases) -> list[str]:
    """Profiler phases a step must spend time in, given the estimator's ``phases()`` declaration."""
    out = ["rollout_generation", "environment", "old_logprob", "update", "weight_sync"]
    out.append("m2" if declared.mechanism2 else "advantage")
    if declared.ref:
        out.append("reference")
    if declared.alignment:
        out += ["teacher_generation", "encoding", "m1_selection", "teacher_forcing"]
    elif declared.teacher_diag:
        out.append("teacher_forcing")
    return out


def scrub(text: str) -> str:
    """A message without this machine's paths (results files travel between machines)."""
    for path, name in ((str(ROOT), "<repo>"), (tempfile.gettempdir(), "<tmp>"), (os.path.expanduser("~"), "~")):
        text = text.replace(path, name)
    return text


def run_case(name: str, overrides: list[str], steps: int, device: str, emit: Callable[[str], None]) -> dict:
    """Train ``steps`` steps of the tiny run with ``overrides``; emit the verdict and the phase table."""
    import torch
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.observe.profiler import format_table, summarize
    from alignopsd.engine.run.trainer import Trainer
    from alignopsd.engine.step.recipe import run_step

    t0 = time.perf_counter()
    result = {"name": name, "ok": False}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as out:
        try:
            cfg = load_config(str(TINY_YAML), [*BASE, *overrides, f"trainer.device={device}", f"output_dir={out}"])
            parts = Trainer(cfg).parts
            model = parts.policy.model
            before = [p.detach().float().cpu().clone() for p in model.parameters()]
            recs = []
            try:
                for s in range(steps):
                    recs.append(run_step(parts, s).metrics)
            finally:
                parts.close()
            after = [p.detach().float().cpu() for p in model.parameters()]
        except Exception as exc:  # noqa: BLE001  (the check reports every failure and goes on)
            result["detail"] = scrub(f"{type(exc).__name__}: {exc}")[:600]
            emit(f"[FAIL] engine {name}: {result['detail']} ({time.perf_counter() - t0:.1f} s)")
            return result
    hist = parts.profiler.history
    want = expected_phases(parts.estimator.phases(cfg.algorithm))
    missing = sorted({k for h in hist for k in want if not h.get(k, 0.0) > 0})
    losses = [r.get("actor/loss", float("nan")) for r in recs]
    n_opt = sum(r.get("update/optimizer_steps", 0.0) for r in recs)
    changed = max(float((a - b).abs().max()) for a, b in zip(after, before))
    problems = []
    if missing:
        problems.append(f"phases without time: {', '.join(missing)}")
    if not all(math.isfinite(x) for x in losses):
        problems.append("non-finite loss")
    if n_opt < 1:
        problems.append("no optimizer step")
    if not changed > 0:
        problems.append("weights unchanged")
    from alignopsd.engine.commands.profile import COUNT_METRICS

    counts = [{k: r[k] for k in COUNT_METRICS if k in r} for r in recs]  # for the cost model's prediction
    summary = summarize(hist, parts.profiler.step_seconds, counts=counts)
    result.update(ok=not problems, summary=summary, cfg=cfg, losses=losses, optimizer_steps=n_opt, max_change=changed)
    detail = (
        f"{steps} steps on {device}, phases {', '.join(want)} ran; loss {', '.join(f'{x:.4g}' for x in losses)}; "
        f"{n_opt:.0f} optimizer steps; max weight change {changed:.2e}"
    )
    if problems:
        detail = "; ".join(problems) + " | " + detail
    emit(f"[{'PASS' if not problems else 'FAIL'}] engine {name}: {detail} ({time.perf_counter() - t0:.1f} s)")
    emit("")
    emit(format_table(summary, f"{name}: {steps} step(s), {torch.device(device).type}"))
    emit("")
    return result


def _kernel_route(dry: bool):
    """The dry run sends the core's CPU tensors to the Triton kernels (interpreter), as CUDA tensors go on a GPU."""
    if not dry:
        return contextlib.nullcontext()
    from alignopsd.testing import force_kernels

    return force_kernels()


def run_engine(device: str, dry: bool, emit: Callable[[str], None], *, steps: int = 2, budget_s: float = 1e9) -> list:
    """Every case of :func:`engine_cases` in turn; cases past ``budget_s`` are reported as skipped."""
    t0 = time.perf_counter()
    results = []
    for name, ov in engine_cases():
        if time.perf_counter() - t0 > budget_s:
            emit(f"[SKIP] engine {name}: past the part's budget of {budget_s:.0f} s")
            results.append({"name": name, "ok": False, "skipped": True})
            continue
        with _kernel_route(dry):
            results.append(run_case(name, [*ov, *(DRY if dry else [])], steps, device, emit))
    return results


def run_scale(device: str, dry: bool, emit: Callable[[str], None]) -> dict:
    """One AlignOPSD step at a quickstart-like batch (smaller in the dry run), with its phase table."""
    with _kernel_route(dry):
        res = run_case("alignopsd quickstart-like", [*SCALE, *(DRY_SCALE if dry else [])], 1, device, emit)
    if "summary" in res:
        s = res["summary"]
        emit(
            f"alignment overhead over GRPO at this size: {100 * s['overhead_vs_grpo']:.1f}% "
            f"({s['alignment_seconds']:.3f} s of {s['step_seconds']:.3f} s per step)"
        )
        try:  # the cost model's work, efficiency and predicted time beside each measured phase
            from alignopsd.engine.lab.efficiency import cost_report

            emit("\n" + cost_report({"alignopsd": s}, res["cfg"], device) + "\n")
        except Exception as exc:  # noqa: BLE001  (the check reports every failure and goes on)
            emit(f"[FAIL] cost model on the quickstart-like step: {scrub(f'{type(exc).__name__}: {exc}')[:300]}")
    return res

"""Mechanism 2 at paper scale: ``allocate_credit`` (vectorised + C++) versus the per-turn loop reference.

Paper scale: 16 tasks x 8 rollouts x 50 turns (M = 6400 canonical turns), L = 512 response tokens.
The batch is random but realistic: each task has a few "phases" (unit prototype vectors); every rollout
walks through them with random dwell times, and the teacher/student thinking embeddings of a turn are
noisy unit vectors around its phase prototype (plus a per-rollout offset for the student). H is the
same-task block of teacher . student cosines, B excludes the own rollout and ~3% invalid thinking, so
profiles are peaked but not one-hot, ~85% of adjacent pairs are valid boundaries and all three boundary
kinds (semantic, guided, forced) occur. Policy masks have 40-512 tokens; ~5% of actions are invalid.

Usage:
    pytest bench/bench_alignment.py --benchmark-only        # pytest-benchmark (ours; reference once)
    python -m bench.bench_alignment [--quick] [--write]     # table (+ bench/results/mechanism2-<date>.md)

``run_mechanism2_case(quick)`` is the entry the benchmark report imports (case ``mechanism2_paper_scale``).
Each provider runs in a fresh subprocess so that its peak resident memory can be measured (the peak
counter is reset after the batch is built, via /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import pytest
import torch

PAPER = dict(tasks=16, rollouts=8, turns=50, L=512)
QUICK = dict(tasks=4, rollouts=8, turns=50, L=512)


def make_batch(
    tasks: int = 16,
    rollouts: int = 8,
    turns: int = 50,
    L: int = 512,
    *,
    dim: int = 64,
    phases: int = 8,
    noise: float = 0.55,
    seed: int = 0,
) -> dict:
    """A realistic Mechanism-2 batch in identity order (see module docstring); also returns ``invalid``."""
    g = torch.Generator().manual_seed(seed)
    m = tasks * rollouts * turns
    task = torch.arange(tasks).repeat_interleave(rollouts * turns)
    rollout = torch.arange(rollouts).repeat_interleave(turns).repeat(tasks)
    turn = torch.arange(turns).repeat(tasks * rollouts)
    proto = torch.nn.functional.normalize(torch.randn(tasks, phases, dim, generator=g), dim=-1)
    cuts = torch.rand(tasks, rollouts, turns, generator=g) < (phases / turns)
    phase = torch.cumsum(cuts.long(), -1).clamp_max(phases - 1).reshape(-1)
    base = proto[task, phase]

    def unit_noise(n: int, scale: float) -> torch.Tensor:
        return scale * torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=-1)

    roll_offset = unit_noise(tasks * rollouts, 0.3).repeat_interleave(turns, 0)
    student = torch.nn.functional.normalize(base + roll_offset + unit_noise(m, noise), dim=-1)
    teacher = torch.nn.functional.normalize(base + unit_noise(m, noise), dim=-1)
    H = torch.zeros(m, m)
    blk = rollouts * turns
    for b in range(tasks):
        sl = slice(b * blk, (b + 1) * blk)
        H[sl, sl] = (teacher[sl] @ student[sl].T).clamp(-1, 1)
    valid_teacher = torch.rand(m, generator=g) > 0.03
    valid_student = torch.rand(m, generator=g) > 0.03
    same = task[:, None] == task[None, :]
    E = same & (rollout[:, None] != rollout[None, :]) & valid_teacher[:, None] & valid_student[None, :]
    lens = torch.randint(40, L + 1, (m,), generator=g)
    mask = torch.arange(L)[None, :] < lens[:, None]
    gap = (0.3 * torch.randn(m, 1, generator=g) + 0.5 * torch.randn(m, L, generator=g)) * mask
    outcome = (torch.rand(tasks * rollouts, generator=g) < 0.5).float().repeat_interleave(turns)
    invalid = torch.rand(m, generator=g) < 0.05
    return dict(
        gap=gap, mask=mask, outcome=outcome, task=task, rollout=rollout, turn=turn, H=H, eligible=E, invalid=invalid
    )


def _ours(batch: dict):
    from alignopsd.credit import CreditConfig, allocate_credit

    b = dict(batch)
    invalid = b.pop("invalid")
    return allocate_credit(**b, config=CreditConfig(), invalid=invalid)


def _reference(batch: dict):
    from alignopsd.credit import CreditConfig
    from alignopsd.testing import allocate_credit_ref

    b = dict(batch)
    invalid = b.pop("invalid")
    return allocate_credit_ref(**b, config=CreditConfig(), invalid=invalid)


def _vm_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(provider: str, scale: dict, reps: int, threads: int, queue) -> None:
    import gc

    torch.set_num_threads(threads)
    batch = make_batch(**scale)
    fn = _ours if provider == "ours" else _reference
    gc.collect()
    rss0 = _vm_kb("VmRSS")
    resettable = _reset_peak()
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn(batch)  # cold call: its peak resident memory above the batch is the memory cost
    first = ((time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3)
    peak_mb = (_vm_kb("VmHWM") - rss0) / 1024 if resettable else float("nan")
    walls, cpus = [first[0]], [first[1]]
    if reps > 1:
        walls, cpus = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.thread_time()
            out = fn(batch)
            cpus.append((time.thread_time() - c0) * 1e3)
            walls.append((time.perf_counter() - t0) * 1e3)
    queue.put(
        dict(
            wall_ms=statistics.median(walls),
            wall_min_ms=min(walls),
            main_thread_cpu_ms=statistics.median(cpus),
            peak_mb=max(peak_mb, 0.0),
            reps=len(walls),
            token_advantage=out.token_advantage.numpy(),  # numpy: pickled by value, not via shared memory
            segment_index=out.segment_index.numpy(),
            threshold=out.threshold,
            metrics=getattr(out, "metrics", {}),
        )
    )


def _run(provider: str, scale: dict, reps: int, threads: int) -> dict:
    # spawned children read OMP_WAIT_POLICY from the inherited environment when torch loads OpenMP
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(provider, scale, reps, threads, q))
    p.start()
    res = q.get()
    p.join()
    return res


def run_mechanism2_case(quick: bool = False, threads: int = 1, omp_wait_policy: str | None = None) -> dict:
    """Time Mechanism 2 (ours vs the loop reference) and check they agree.

    quick: 4 tasks (M = 1600) instead of the paper's 16 (M = 6400). threads: torch threads of both
    providers (default 1: on a small shared machine a second OpenMP thread waits for a busy core at
    every parallel op, which made a 2-thread run 7x slower than a 1-thread run here).
    omp_wait_policy: OMP_WAIT_POLICY for the measuring processes ("PASSIVE" lets idle OpenMP workers
    sleep instead of spin; on the shared machine it made 2 threads 18x faster). Default: inherited.
    Returns ours_ms, base_ms (medians of wall time), ours_peak_mb, base_peak_mb (peak resident memory
    above the batch), ours_cpu_ms/base_cpu_ms (main-thread CPU time), speedup, agreement and context.
    """
    scale = QUICK if quick else PAPER
    saved = os.environ.get("OMP_WAIT_POLICY")
    if omp_wait_policy is not None:
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy
    try:
        ours = _run("ours", scale, 5 if quick else 15, threads)
        base = _run("reference", scale, 1, threads)
    finally:
        if omp_wait_policy is not None:
            if saved is None:
                os.environ.pop("OMP_WAIT_POLICY", None)
            else:
                os.environ["OMP_WAIT_POLICY"] = saved
    agree = bool((ours["segment_index"] == base["segment_index"]).all())
    max_diff = float(abs(ours["token_advantage"] - base["token_advantage"]).max())
    m = ours["metrics"]
    return dict(
        case="mechanism2_paper_scale" if not quick else "mechanism2_quick",
        M=scale["tasks"] * scale["rollouts"] * scale["turns"],
        L=scale["L"],
        threads=threads,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "") if omp_wait_policy is None else omp_wait_policy,
        ours_ms=ours["wall_ms"],
        ours_min_ms=ours["wall_min_ms"],
        ours_cpu_ms=ours["main_thread_cpu_ms"],
        base_ms=base["wall_ms"],
        base_cpu_ms=base["main_thread_cpu_ms"],
        ours_peak_mb=ours["peak_mb"],
        base_peak_mb=base["peak_mb"],
        speedup=base["wall_ms"] / ours["wall_ms"],
        segments_equal=agree,
        token_advantage_max_abs_diff=max_diff,
        load_average=os.getloadavg()[0],
        segment_count=m.get("m2/segment_count", math.nan),
        semantic=m.get("m2/semantic_boundary_count", math.nan),
        guided=m.get("m2/correspondence_guided_fallback_boundary_count", math.nan),
        forced=m.get("m2/forced_max_boundary_count", math.nan),
        profile_valid_rate=m.get("m2/profile_valid_rate", math.nan),
        valid_pair_rate=m.get("m2/valid_jsd_pair_rate", math.nan),
        projection_activation_rate=m.get("m2/projection_activation_rate", math.nan),
    )


def format_table(r: dict) -> str:
    rows = [
        ("provider", "median wall ms", "main-thread CPU ms", "peak MB"),
        ("ours (allocate_credit)", f"{r['ours_ms']:.1f}", f"{r['ours_cpu_ms']:.1f}", f"{r['ours_peak_mb']:.0f}"),
        ("loop reference", f"{r['base_ms']:.0f}", f"{r['base_cpu_ms']:.0f}", f"{r['base_peak_mb']:.0f}"),
    ]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|---|---|---|---|")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ pytest-benchmark


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Same setting as the command line default (see ``run_mechanism2_case``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_mechanism2_ours(benchmark):
    batch = make_batch(**PAPER)
    credit = benchmark(_ours, batch)
    assert credit.token_advantage.shape == (6400, 512)


def test_mechanism2_loop_reference(benchmark):
    batch = make_batch(**PAPER)
    ref = benchmark.pedantic(_reference, args=(batch,), rounds=1, iterations=1)
    assert ref.token_advantage.shape == (6400, 512)


# ------------------------------------------------------------------------------------------------ command line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 1600 instead of 6400")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--omp-wait-policy", default=None, help="OMP_WAIT_POLICY of the measuring processes")
    ap.add_argument("--write", action="store_true", help="write bench/results/mechanism2-<date>.md")
    args = ap.parse_args()
    r = run_mechanism2_case(quick=args.quick, threads=args.threads, omp_wait_policy=args.omp_wait_policy)
    print(format_table(r))
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    if args.write:
        day = _dt.date.today().isoformat()
        path = Path(__file__).parent / "results" / f"mechanism2-{day}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (
            f"# Mechanism 2 at paper scale ({day})\n\n"
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, {r['threads']} torch thread(s), OMP_WAIT_POLICY={r['omp_wait_policy'] or 'unset'}, "
            f"load average {r['load_average']:.1f}.\n"
            f"M = {r['M']}, L = {r['L']}.\n\n{format_table(r)}\n\n"
            f"speedup {r['speedup']:.0f}x; segments equal: {r['segments_equal']}; max |token advantage diff| "
            f"{r['token_advantage_max_abs_diff']:.2e}\n"
        )
        with open(path, "a") as f:
            f.write(text + "\n")
        print(f"appended to {path}")


if __name__ == "__main__":
    main()

"""Kernel benchmark report: ours against plain torch, median time and peak memory, in one run.

Usage:
    python -m bench.report [--quick] [--json FILE] [--markdown FILE] [--cases a,b,...]

Writes the rows to ``bench/results/<machine>-<date>.csv`` (rows keyed by machine, package version,
date, case and size; a rerun replaces its own rows), prints a markdown table and, with ``--json``,
writes ``{case: {ours_ms, base_ms, speedup, ours_peak_mb, base_peak_mb, memory_ratio}}``
(speedup = base_ms / ours_ms, memory_ratio = ours_peak_mb / base_peak_mb).

Time: median wall time over ``reps`` calls after one warm-up call each, ours and baseline interleaved
(so that a change of machine load hits both).

Peak memory (CPU): the allocation peak of one call, from torch's profiler memory events
(``torch.profiler.profile(profile_memory=True)``): every tensor allocation and free made by the
CPU allocator during the call is an event with a signed byte count; the peak is the maximum of their
running sum, i.e. the largest amount of tensor memory allocated by the call on top of what existed
when it started (its inputs are not counted; tensors it returns or leaves alive, such as ``.grad``,
are). It counts exactly the same events for ours and the baseline, is independent of the process'
resident size and of allocator caching, and ignores non-tensor memory (Python objects, library
workspaces). On CUDA the same numbers come from ``torch.cuda.max_memory_allocated`` above the
starting allocation. Rows imported from other benchmarks keep their own measurement (they say so).

Machine: ``<os>-<arch>-<n>cpu`` (plus the GPU name on CUDA); no host names.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from bench.measure import median_times, peak_mb

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = [
    "machine",
    "version",
    "date",
    "case",
    "size",
    "ours_ms",
    "base_ms",
    "speedup",
    "ours_peak_mb",
    "base_peak_mb",
    "memory_ratio",
    "torch",
    "threads",
    "info",
    "check",
]
CASE_ORDER = [
    "logprob_smollm2_fwd",
    "logprob_smollm2_fwdbwd",
    "logprob_smollm2_fwdbwd_autograd",
    "logprob_qwen7b_fwd",
    "logprob_qwen7b_fwdbwd",
    "logprob_qwen7b_fwdbwd_autograd",
    "alignment_kernels_d384",
    "alignment_kernels_d1024",
    "alignment_kernels_d384_core",
    "alignment_kernels_d1024_core",
    "mechanism2_paper_scale",
    "rescoring_shared_prefix",
    "ppo_microbatch_smollm2",
]
IMPORTED = ("mechanism2_paper_scale", "rescoring_shared_prefix", "ppo_microbatch_smollm2")  # own measurements


def machine_id(device: str = "cpu") -> str:
    base = f"{platform.system().lower()}-{platform.machine()}-{os.cpu_count()}cpu"
    if device == "cuda" and torch.cuda.is_available():
        base += "-" + torch.cuda.get_device_name().lower().replace(" ", "_")
    return base


def package_version() -> str:
    try:
        import alignopsd

        return alignopsd.__version__
    except Exception:  # noqa: BLE001
        return "unknown"


# ----------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------
def build_case(name: str, quick: bool, device: str):
    from bench import kernel_cases as kc

    if name.startswith("logprob_"):
        _, model, mode = name.split("_", 2)
        return kc.logprob_case(model, mode, quick, device)
    if name.startswith("alignment_kernels_d"):
        rest = name[len("alignment_kernels_d") :]
        core = rest.endswith("_core")
        dim = int(rest.removesuffix("_core"))
        return kc.alignment_case(dim, quick, against="core" if core else "loop")
    raise KeyError(name)


def run_kernel_case(name: str, quick: bool, device: str = "cpu") -> dict:
    case = build_case(name, quick, device)
    ours_ms, base_ms = median_times(case.ours, case.base, case.reps, device, case.warmup)
    ours_mb, out_o = peak_mb(case.ours, device)
    base_mb, out_b = peak_mb(case.base, device)
    check = case.check(out_o, out_b)
    del out_o, out_b, case
    return dict(
        ours_ms=ours_ms,
        base_ms=base_ms,
        ours_peak_mb=ours_mb,
        base_peak_mb=base_mb,
        info=" ".join(f"{k}={v}" for k, v in build_info(name, quick).items()),
        check=check,
    )


def build_info(name: str, quick: bool) -> dict:
    from bench import kernel_cases as kc

    if name.startswith("logprob_"):
        _, model, mode = name.split("_", 2)
        H, V, n_full, n_quick = kc.LOGPROB_SHAPES[model]
        info = dict(N=n_quick if quick else n_full, H=H, V=V, dtype="fp32", mode=mode)
        if mode == "fwdbwd":
            info["loss"] = "ppo-clip"
            info["dW"] = "accumulated-into-fp32-buffer"
        if mode == "fwdbwd_autograd":
            info["dW_MiB"] = round(V * H * 4 / 2**20)  # the fresh weight gradient both sides allocate
        return info
    rest = name[len("alignment_kernels_d") :]
    tasks = 4 if quick else 16
    base = "core-dense" if rest.endswith("_core") else "loop-over-tasks"
    return dict(M=tasks * 400, D=int(rest.removesuffix("_core")), baseline=base)


def run_imported_case(name: str, quick: bool) -> dict | None:
    """Rows from other benchmark modules, when present. Returns None (with a note) when absent."""
    try:
        if name == "mechanism2_paper_scale":
            from bench.bench_alignment import run_mechanism2_case as fn
        elif name == "rescoring_shared_prefix":
            from bench.bench_rescoring import run_rescoring_case as fn
        elif name == "ppo_microbatch_smollm2":
            from bench.bench_update import run_update_case as fn
        else:
            raise KeyError(name)
    except ImportError as exc:
        print(f"note: {name} skipped ({exc})", file=sys.stderr)
        return None
    r = fn(quick)
    keep = {k: v for k, v in r.items() if isinstance(v, (int, float, str, bool)) and k not in FIELDS}
    return dict(
        ours_ms=float(r["ours_ms"]),
        base_ms=float(r["base_ms"]),
        ours_peak_mb=float(r["ours_peak_mb"]),
        base_peak_mb=float(r["base_peak_mb"]),
        info="own measurement (see its module); " + " ".join(f"{k}={v}" for k, v in list(keep.items())[:8]),
        check="",
    )


def finish_row(name: str, quick: bool, r: dict, device: str) -> dict:
    speedup = r["base_ms"] / r["ours_ms"] if r["ours_ms"] > 0 else math.nan
    ratio = r["ours_peak_mb"] / r["base_peak_mb"] if r["base_peak_mb"] > 0 else math.nan
    return dict(
        machine=machine_id(device),
        version=package_version(),
        date=str(_dt.date.today()),
        case=name,
        size="quick" if quick else "full",
        ours_ms=round(r["ours_ms"], 3),
        base_ms=round(r["base_ms"], 3),
        speedup=round(speedup, 3),
        ours_peak_mb=round(r["ours_peak_mb"], 3),
        base_peak_mb=round(r["base_peak_mb"], 3),
        memory_ratio=round(ratio, 4),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        info=r.get("info", "") + f" load={os.getloadavg()[0]:.1f}",
        check=r.get("check", ""),
    )


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------
def write_csv(rows: list[dict], path: Path) -> None:
    """Merge ``rows`` into ``path``; a row replaces an older one with equal (machine, version, date, case, size)."""
    key = ("machine", "version", "date", "case", "size")
    old = []
    if path.exists():
        with path.open() as f:
            old = list(csv.DictReader(f))
    new_keys = {tuple(r[k] for k in key) for r in rows}
    kept = [r for r in old if tuple(r.get(k, "") for k in key) not in {tuple(map(str, t)) for t in new_keys}]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in kept + rows:
            w.writerow(r)


def markdown(rows: list[dict], skipped: list[str]) -> str:
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    lines = [
        f"Kernel benchmarks: machine `{r0['machine']}`, alignopsd {r0['version']}, torch {r0['torch']}, "
        f"{r0['threads']} threads, {r0['date']}, size {r0['size']}",
        "",
        "| case | ours (ms) | plain torch (ms) | speedup | ours peak (MiB) | plain peak (MiB) | memory ratio "
        "| shapes | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['ours_ms']:.1f} | {r['base_ms']:.1f} | {r['speedup']:.2f}x | "
            f"{r['ours_peak_mb']:.1f} | {r['base_peak_mb']:.1f} | {r['memory_ratio']:.3f} | {r['info']} | "
            f"{r['check']} |"
        )
    for s in skipped:
        lines.append(f"\n_{s}_")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Kernel benchmarks: ours vs plain torch (time and peak memory).")
    ap.add_argument("--quick", action="store_true", help="the same cases at sizes that finish within two minutes")
    ap.add_argument("--json", default=None, help="write {case: {ours_ms, base_ms, speedup, ...}} to this file")
    ap.add_argument("--markdown", default=None, help="also write the markdown table to this file")
    ap.add_argument("--cases", default=None, help="comma-separated subset of: " + ", ".join(CASE_ORDER))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-csv", action="store_true", help="do not write bench/results/<machine>-<date>.csv")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = CASE_ORDER if not args.cases else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASE_ORDER]
    if unknown:
        ap.error(f"unknown case(s): {', '.join(unknown)}")
    rows, skipped = [], []
    for name in names:
        t0 = time.perf_counter()
        if name in IMPORTED:
            r = run_imported_case(name, args.quick)
            if r is None:
                skipped.append(f"{name}: skipped, its benchmark module is not present")
                continue
        else:
            r = run_kernel_case(name, args.quick, args.device)
        row = finish_row(name, args.quick, r, args.device)
        rows.append(row)
        print(
            f"[{time.perf_counter() - t0:6.1f}s] {name}: ours {row['ours_ms']:.1f} ms, base {row['base_ms']:.1f} ms, "
            f"x{row['speedup']:.2f}; peak {row['ours_peak_mb']:.1f}/{row['base_peak_mb']:.1f} MiB; {row['check']}",
            file=sys.stderr,
            flush=True,
        )
    md = markdown(rows, skipped)
    print(md)
    if not args.no_csv and rows:
        write_csv(rows, RESULTS / f"{rows[0]['machine']}-{rows[0]['date']}.csv")
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.json:
        keys = ("ours_ms", "base_ms", "speedup", "ours_peak_mb", "base_peak_mb", "memory_ratio")
        Path(args.json).write_text(json.dumps({r["case"]: {k: r[k] for k in keys} for r in rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

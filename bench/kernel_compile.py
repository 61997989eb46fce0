"""Ahead-of-time compile check of the Triton kernels for sm_80 (A100 / A800) and sm_90a (H100 / H200), no GPU needed.

    python -m bench.kernel_compile [--out FILE.md] [--cache FILE.json] [--no-cache]

Compiles every kernel of ``alignopsd.kernels`` with every configuration of ``alignopsd.kernels.tuning`` (the ones
the engine's default and autotuner can pick) and the comparison configurations of ``bench.kernel_specs``, for
every operand dtype the engine passes, through triton's real pipeline down to a cubin
(``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``). Registers and local memory (the stack
frame, where ptxas spills) come from the cubin via the ``cuobjdump`` bundled with triton, shared memory from
triton's metadata. Writes a markdown table to ``--out``. Exit status 1 when a compile fails, when shared memory
exceeds the architecture's per-block limit, or when a configuration the engine uses has local memory in
bf16/fp16; 0 otherwise. Results are cached in ``--cache`` (committed, so CI compiles only what changed) keyed by
the kernel's source hash, triton's version, architecture, dtype, flags and configuration.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = ROOT / "bench" / "results" / "kernel_compile.json"

# per architecture: registers per SM, shared memory per SM and the largest per block (opt-in), bytes
ARCH_LIMITS = {
    80: {"regs": 65536, "smem_sm": 167936, "smem_block": 166912, "max_warps": 64, "max_blocks": 32},
    90: {"regs": 65536, "smem_sm": 233472, "smem_block": 232448, "max_warps": 64, "max_blocks": 32},
}


@dataclass
class Record:
    kernel: str
    dtype: str
    arch: int
    config: str
    engine: bool  # one of the configurations the engine can launch (else a comparison row)
    regs: int = 0
    local_bytes: int = 0
    smem_bytes: int = 0
    occupancy: float = 0.0
    error: str = ""


def occupancy(arch: int, regs: int, smem: int, num_warps: int) -> float:
    """Resident warps / maximum warps per SM, from registers (allocated per warp in 256s), shared memory
    (plus 1 KiB reserved per block) and the block and warp limits."""
    lim = ARCH_LIMITS[arch]
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (lim["regs"] // per_warp) // num_warps
    by_smem = lim["smem_sm"] // (smem + 1024) if smem else lim["max_blocks"]
    blocks = min(by_regs, by_smem, lim["max_blocks"], lim["max_warps"] // num_warps)
    return blocks * num_warps / lim["max_warps"]


def cuobjdump_path() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"cuobjdump: not found in the triton package at {path}")
    return str(path)


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes = stack frame + local) per thread of the cubin's one function."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name], capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if "REG:" in ln), None)
    if line is None:
        raise RuntimeError(f"cuobjdump: no resource line in {out.stdout!r} {out.stderr!r}")
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return int(fields["REG"]), int(fields["STACK"]) + int(fields["LOCAL"])


def compile_one(fn, types: dict[str, str], constexprs: dict, arch: int, num_warps: int, num_stages: int):
    """Compile ``fn`` for ``sm_<arch>``; returns (registers, local bytes, shared bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    jf = JITFunction(fn)  # the compiler's function, whatever TRITON_INTERPRET says
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn).parameters):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        t = types[name]
        sig[name] = t.rstrip("!")
        if t.startswith("*") or t.endswith("!"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(jf, sig, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    regs, local = resource_usage(k.asm["cubin"])
    return regs, local, int(k.metadata.shared)


def _cache_key(fn, dtype: str, arch: int, flags: dict, cfg) -> str:
    import triton

    src = inspect.getsource(fn)
    blob = json.dumps(
        [
            src,
            triton.__version__,
            dtype,
            arch,
            sorted(flags.items()),
            sorted(cfg.meta.items()),
            cfg.num_warps,
            cfg.num_stages,
        ],
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def jobs():
    """(spec, dtype, arch, config, engine?) for every row of the table."""
    from alignopsd.kernels.tuning import ARCHS, configs_for

    from .kernel_specs import SPECS

    for spec in SPECS:
        for dtype in spec.dtypes:
            for arch in ARCHS:
                for cfg in configs_for(spec.name, arch):
                    yield spec, dtype, arch, cfg, True
                for cfg in spec.alternatives:
                    yield spec, dtype, arch, cfg, False
        for dtype in spec.unaligned:  # comparison rows: sizes that are not multiples of 16 (not the paper's)
            for arch in ARCHS:
                for cfg in configs_for(spec.name, arch):
                    yield spec, f"{dtype} unaligned", arch, cfg, False


def _base(dtype: str) -> str:
    return dtype.split()[0]


def _types(spec, dtype: str) -> dict[str, str]:
    """Argument types of ``spec`` for table dtype ``dtype`` ("bf16", or "bf16 unaligned": integer sizes and
    strides not divisible by 16; pointers stay 16-byte aligned as torch allocates them)."""
    types = spec.types(_base(dtype))
    if dtype.endswith(" unaligned"):
        types = {k: v if v.startswith("*") else v.rstrip("!") for k, v in types.items()}
    return types


def _compile_job(name: str, dtype: str, arch: int, meta: dict, num_warps: int, num_stages: int) -> dict:
    """One compile in a worker process: the cache entry (registers, local, shared bytes, error)."""
    from .kernel_specs import SPECS

    spec = next(s for s in SPECS if s.name == name)
    try:
        regs, local, smem = compile_one(
            spec.function(), _types(spec, dtype), {**spec.flags(_base(dtype)), **meta}, arch, num_warps, num_stages
        )
        return {"regs": regs, "local": local, "smem": smem, "error": ""}
    except Exception as e:  # noqa: BLE001  (a compile error is a result of the check)
        msg = str(e).splitlines()[0] if str(e) else ""
        return {"regs": 0, "local": 0, "smem": 0, "error": f"{type(e).__name__}: {msg}"[:200]}


def run_all(cache: dict, log=print, save=None, workers: int = 1) -> list[Record]:
    """A record per job, compiling the ones ``cache`` lacks (in ``workers`` processes) and adding them to it."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    rows = []
    for spec, dtype, arch, cfg, engine in jobs():
        key = _cache_key(spec.function(), dtype, arch, spec.flags(_base(dtype)), cfg)
        rows.append((key, spec, dtype, arch, cfg, engine))
    missing = {}
    for key, spec, dtype, arch, cfg, _ in rows:
        if key not in cache:
            missing[key] = (spec.name, dtype, arch, dict(cfg.meta), cfg.num_warps, cfg.num_stages)
    if missing:
        t0 = time.time()
        with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {pool.submit(_compile_job, *job): key for key, job in missing.items()}
            for fut in as_completed(futures):
                key = futures[fut]
                cache[key] = fut.result()
                name, dtype, arch, meta, nw, ns = missing[key]
                log(f"compiled {name} {dtype} sm_{arch} {meta} w{nw} s{ns} ({time.time() - t0:.0f} s)")
                if save is not None:  # as it goes: an interrupted run keeps what it compiled
                    save(cache)
    records = []
    for key, spec, dtype, arch, cfg, engine in rows:
        hit = cache[key]
        rec = Record(spec.name, dtype, arch, cfg.label(), engine, hit["regs"], hit["local"], hit["smem"])
        rec.error = hit["error"]
        if not rec.error:
            rec.occupancy = occupancy(arch, rec.regs, rec.smem_bytes, cfg.num_warps)
        records.append(rec)
    return records


def problems(records: list[Record]) -> list[str]:
    """What fails the check: compile errors, shared memory over the per-block limit, and local memory in an
    engine configuration in bf16/fp16 (fp32 spills are reported in the table but tolerated)."""
    out = []
    for r in records:
        where = f"{r.kernel} {r.dtype} sm_{r.arch} [{r.config}]"
        if r.error:
            out.append(f"{where}: compile error: {r.error}")
            continue
        if r.smem_bytes > ARCH_LIMITS[r.arch]["smem_block"]:
            out.append(f"{where}: shared memory {r.smem_bytes} B over the {ARCH_LIMITS[r.arch]['smem_block']} B limit")
        if r.engine and _base(r.dtype) in ("bf16", "fp16") and r.local_bytes > 0:
            out.append(f"{where}: {r.local_bytes} B of local memory per thread (register spills)")
    return out


def table(records: list[Record]) -> str:
    lines = [
        "| kernel | dtype | arch | configuration | engine | regs | local B | smem B | occupancy |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in records:
        if r.error:
            lines.append(
                f"| {r.kernel} | {r.dtype} | sm_{r.arch} | {r.config} | {'yes' if r.engine else 'no'} | "
                f"compile error: {r.error} | | | |"
            )
            continue
        lines.append(
            f"| {r.kernel} | {r.dtype} | sm_{r.arch} | {r.config} | {'yes' if r.engine else 'no'} | {r.regs} | "
            f"{r.local_bytes} | {r.smem_bytes} | {r.occupancy:.0%} |"
        )
    return "\n".join(lines)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _header(argv: list[str]) -> str:
    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if "model name" in ln), "?")
    bf16 = "avx512_bf16" in _read("/proc/cpuinfo")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        "# Triton kernels compiled ahead of time for sm_80 and sm_90a\n\n"
        f"Command: `python -m bench.kernel_compile {' '.join(argv)}`; commit {commit.strip() or 'unknown'}; "
        f"triton {triton.__version__}; host {platform.machine()} (no GPU: triton's compiler and its bundled "
        f"ptxas / cuobjdump); CPU {cpu} (avx512_bf16: {'yes' if bf16 else 'no'}), load average {load:.1f} (compile "
        f"times only; the numbers do not depend on it); date {time.strftime('%Y-%m-%d', time.gmtime())}.\n\n"
        "Registers and local memory (stack frame: spills) per thread from `cuobjdump --dump-resource-usage`; shared "
        "memory per block from triton's metadata; occupancy = resident warps / 64 from registers, shared memory "
        "and block limits. `engine` = a configuration of `alignopsd.kernels.tuning` (default or autotuned); "
        "`no` rows are comparisons (the former single configuration, larger tiles, and `unaligned`: the engine's "
        "configurations with hidden size, vocabulary and strides not multiples of 16, which the paper's and the "
        "quickstart's models do not have). Otherwise argument alignment as the paper's shapes give it (16-byte "
        "pointers; hidden, vocabulary, strides divisible by 16).\n\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_compile", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernel-compile.md"))
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    ap.add_argument("--no-cache", action="store_true", help="compile everything again (the cache is rewritten)")
    ap.add_argument("--jobs", type=int, default=1, help="compiler processes (default 1)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton's default, stated (silences its warning)
    cache_path = Path(args.cache)
    cache = {} if args.no_cache or not cache_path.exists() else json.loads(cache_path.read_text())
    n_before = len(cache)

    def save(c: dict) -> None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(dict(sorted(c.items())), indent=0) + "\n")

    records = run_all(cache, log=lambda s: print(s, file=sys.stderr, flush=True), save=save, workers=args.jobs)
    used = {_cache_key(s.function(), d, a, s.flags(_base(d)), c) for s, d, a, c, _ in jobs()}
    kept = {k: v for k, v in cache.items() if k in used}  # drop entries of changed sources
    if len(kept) != n_before or args.no_cache or not cache_path.exists():
        save(kept)
    bad = problems(records)
    report = (
        _header(argv)
        + table(records)
        + "\n\n"
        + (
            "Problems:\n" + "\n".join(f"- {p}" for p in bad)
            if bad
            else "No compile error, no shared memory over the "
            "per-block limit, no local memory in an engine configuration in bf16/fp16."
        )
        + "\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

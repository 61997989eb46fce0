"""The ``configs`` part of the GPU check: the compile table's configurations run on the GPU (autotune on), then
each kernel's time beside its roofline bound (``alignopsd.kernels.tuning.roofline``).

For every Triton kernel, one launch through the engine's own entry point at the paper's shapes makes triton's
autotuner benchmark every configuration of this GPU's architecture (the rows of ``bench.kernel_compile``'s
table); the part prints the autotuner's time per configuration and its choice, then times the entry with the
chosen configuration (``triton.testing.do_bench`` median) and prints it next to the bound for this GPU.
Dry run (CPU, Triton interpreter, tiny shapes): autotuning is off, so the default configuration runs and the
bound is that of an A800; times are wall-clock and meaningless.
"""

from __future__ import annotations

import math
from collections.abc import Callable

GPU_KEYS = {"a800": "a800", "a100": "a800", "h200": "h200", "h100": "h200", "gh200": "h200"}


def gpu_key(device_name: str, major: int) -> str:
    """The ``tuning.GPUS`` entry whose peaks apply: by name when known, else by architecture."""
    low = device_name.lower()
    for k, v in GPU_KEYS.items():
        if k in low:
            return v
    return "h200" if major >= 9 else "a800"


def kernel_cases(device: str, dry: bool) -> list[tuple[str, tuple[int, ...], Callable[[], object]]]:
    """(kernel name, roofline shape, entry call that launches it) at the paper's shapes (dry run: tiny)."""
    import torch
    from alignopsd.kernels import boundary_scores_blocks, logprob, sibling_topk

    N, H, V = (4096, 3584, 152064) if not dry else (37, 72, 1031)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, H, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, device=device, generator=g) / math.sqrt(H)).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=device, generator=g)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_fwd_out = logprob(hg, wg, t, impl="triton", with_entropy=True)
    loss = lp_fwd_out[0].sum() + lp_fwd_out[1].sum()

    def fwd():
        with torch.no_grad():
            return logprob(h, w, t, impl="triton", with_entropy=True)

    def bwd():
        hg.grad = wg.grad = None
        return torch.autograd.grad(loss, (hg, wg), retain_graph=True)

    tasks, rollouts, turns, D = (16, 8, 50, 1024) if not dry else (2, 3, 5, 33)
    M = tasks * rollouts * turns
    task = torch.arange(tasks, device=device).repeat_interleave(rollouts * turns)
    roll = torch.arange(rollouts, device=device).repeat_interleave(turns).repeat(tasks)
    turn = torch.arange(turns, device=device).repeat(tasks * rollouts)
    te = torch.nn.functional.normalize(torch.randn(M, D, device=device, generator=g), dim=-1).to(torch.bfloat16)
    st = torch.nn.functional.normalize(torch.randn(M, D, device=device, generator=g), dim=-1).to(torch.bfloat16)
    ok = torch.ones(M, dtype=torch.bool, device=device)
    kw = dict(gamma=0.0, top_k=3, profile_temperature=0.1, impl="triton")
    res = sibling_topk(te, st, task, roll, turn, ok, ok, **kw)
    n_slots = res.blocks.idx_TN.shape[1]

    def sib():
        return sibling_topk(te, st, task, roll, turn, ok, ok, **kw)

    def pair():
        return boundary_scores_blocks(res.P_BTS, res.E_BTS, res.profile_valid, res.blocks, impl="triton")

    return [
        ("_lp_fwd_kernel", (N, V, H), fwd),
        ("_lp_bwd_kernel", (N, V, H), bwd),
        ("_sibling_kernel", (tasks, n_slots, D), sib),
        ("_pair_kernel", (tasks * n_slots, n_slots), pair),
    ]


def run_configs(device: str, dry: bool, emit: Callable[[str], None], bench_ms: Callable, past_deadline) -> list:
    """Autotune, then time, every kernel; returns ``(name, ok, detail)`` results (ok: it ran and was timed)."""
    import torch
    from alignopsd.kernels.tuning import arch_of, autotune_enabled, autotune_results, default_config, roofline

    dev = torch.device(device)
    arch = arch_of(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    gpu = gpu_key(name, 9 if arch == 90 else 8)
    emit(
        f"configurations of sm_{arch}; autotune {'on' if autotune_enabled() else 'off (default configuration)'}; "
        f"roofline peaks of the {gpu.upper()}"
    )
    emit("| kernel | shape | configuration | time (ms) | roofline bound (ms) | of bound |")
    emit("|---|---|---|---:|---:|---:|")
    results = []
    for kernel, shape, call in kernel_cases(device, dry):
        if past_deadline(kernel):
            results.append((f"configs {kernel}", False, "skipped: past the part's budget"))
            continue
        call()  # first launch: the autotuner benchmarks every configuration of this architecture
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best, rows = autotune_results(kernel, arch)
        for label, ms in rows:
            emit(f"| {kernel} | {shape} | {label} (autotuner) | {ms:.3f} | | |")
        chosen = best or default_config(kernel, arch).label()
        ms = bench_ms(call, device)
        bound = roofline(kernel, shape, gpu)["bound_ms"]
        emit(f"| {kernel} | {shape} | {chosen} | {ms:.3f} | {bound:.3g} | {bound / ms:.0%} |")
        results.append((f"configs {kernel}", True, f"{chosen}: {ms:.3f} ms, bound {bound:.3g} ms"))
    return results

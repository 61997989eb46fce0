"""GPU check: the Triton kernels' correctness, the training engine on the device, then the kernel timings.

Run through ``bench/gpu_check.sh`` on a CUDA machine (no installs; the image's torch, triton and transformers;
the project need not be installed: the source folders are mapped as ``alignopsd.kernels`` / ``alignopsd.engine``).
``--dry-run`` runs the same code on CPU under the Triton interpreter with tiny shapes (this is how it is tested
without a GPU); timings are then wall-clock and meaningless. Five parts, in this order (``--part`` runs one;
the shell script runs each in its own process under its own timeout): ``configs`` (autotuning and time against
the roofline bound, see below), ``kernels`` (the checks below),
``engine`` and ``scale`` (bench/gpu_engine_check.py: 2 tiny training steps per estimator / ablation, one
quickstart-like AlignOPSD step, each with its per-phase table), ``timing`` (the table below, within
``--budget``). Every line is appended to ``--out`` as soon as it is known.

Kernel checks (GPU shapes; dry-run shapes in brackets):
- logprob, bf16 and fp32, forward + entropy and gradients (hidden, weight): three-way tolerance
  (kernel error vs the fp32 reference <= 2 x plain torch's error in the same dtype + atol).
  Qwen2.5-7B head H=3584, V=152064, N=4096 and SmolLM2 head H=576, V=49152, N=8192 [N=37, H=72, V=1031].
- sibling_topk, fp32 and bf16 embeddings, 16 tasks x 8 rollouts x 50 turns, D=1024 [2 x 3 x 5, D=33]:
  H against the fp32 torch path (three-way), selections equal to the core's select_sources on the
  kernel's H (exact), profiles against correspondence_profiles, validity equal.
- boundary_scores (jsd, entropy, cosine) on those profiles: Triton against the torch path and the core.
- the core's own dispatch, 16 tasks x 8 rollouts x 50 turns [2 x 3 x 6]: select_sources,
  correspondence_profiles and allocate_credit on CUDA tensors (routed to the kernels; dry run: under
  ``force_kernels()``) against the same calls on CPU tensors (the core's torch path).
Timing: ``triton.testing.do_bench`` medians (ms) of ours vs plain torch; for log-prob also the FLOP
floor (2 N H V per matmul; forward 1 matmul, backward 3 in ours, 2 minimum) and the byte floor
(weights + hidden read once), with the achieved fraction of the device peak (``--peak-tflops``,
``--peak-gbps``; defaults for known GPUs).
Before these, the ``configs`` part (bench/gpu_configs.py) launches every kernel once with autotuning on, so the
compile table's configurations (bench/kernel_compile.py) run on the GPU, and prints each kernel's time beside
its roofline bound (alignopsd.kernels.tuning).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def _map_package(name: str, folder: str) -> None:
    """Import the source folder ``folder`` as package ``name`` (its subpackages resolve inside it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, mod)


def _setup_imports(dry_run: bool) -> None:
    """Make ``alignopsd``, ``alignopsd.kernels`` and ``alignopsd.engine`` importable without installing the
    project: the source folders kernels/ and engine/ are mapped by hand when the package has no such members."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported in this process
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, folder in (("alignopsd.kernels", "kernels"), ("alignopsd.engine", "engine")):
        try:
            __import__(name)
        except ImportError:
            if root not in sys.path:
                sys.path.insert(0, root)
            import alignopsd  # noqa: F401

            _map_package(name, os.path.join(root, folder))


def peak_table() -> dict[str, tuple[float, float]]:
    """Dense bf16 TFLOP/s and HBM GB/s by GPU name: the engine's table (engine/lab/device_limits.py, sources
    cited there), read after the imports are set up."""
    from alignopsd.engine.lab.device_limits import GPU_PEAKS

    return {k: (tf, gbs) for k, (tf, gbs, _src) in GPU_PEAKS.items()}


RESULTS: list[tuple[str, bool, str]] = []
CHECKS = True  # correctness checks (the "kernels" part)
TIMING = True  # timing rows (the "timing" part)
DEADLINE = math.inf  # perf_counter() past which timings are skipped
_OUT = None  # the results file, appended to and flushed line by line


def emit(line: str = "") -> None:
    """Print ``line`` and append it to the results file at once (a run cut off later keeps it)."""
    print(line, flush=True)
    if _OUT is not None:
        _OUT.write(line + "\n")
        _OUT.flush()


def record(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    emit(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")


def time_row(label: str, ours_ms: float, torch_ms: float, note: str) -> None:
    emit(f"| {label} | {ours_ms:.3f} | {torch_ms:.3f} | {torch_ms / ours_ms:.2f}x | {note} |")


def past_deadline(label: str) -> bool:
    if time.perf_counter() <= DEADLINE:
        return False
    emit(f"| {label} | - | - | - | skipped: past the part's budget |")
    return True


def three_way(ours, plain, ref, atol: float) -> tuple[bool, str]:
    e_o = float((ours.detach().float() - ref.detach().float()).abs().max())
    e_p = float((plain.detach().float() - ref.detach().float()).abs().max())
    return e_o <= 2 * e_p + atol, f"err {e_o:.2e} vs plain {e_p:.2e} (+{atol:.0e})"


def bench_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median"))
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[1]


# ----------------------------------------------------------------------------------------------
def check_logprob(device: str, dry: bool, peak: tuple[float, float]) -> None:
    import importlib

    import torch

    lp_mod = importlib.import_module("alignopsd.kernels.head.logprob")
    shapes = [("qwen7b", 4096, 3584, 152064), ("smollm2", 8192, 576, 49152)] if not dry else [("tiny", 37, 72, 1031)]
    for name, N, H, V in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            if dtype == torch.float32 and name == "qwen7b":
                N_ = N // 4  # the fp32 reference's [N, V] logits and grads must fit too
            else:
                N_ = N
            g = torch.Generator(device=device).manual_seed(0)
            h = torch.randn(N_, H, device=device, generator=g).to(dtype)
            w = (torch.randn(V, H, device=device, generator=g) / math.sqrt(H)).to(dtype)
            t = torch.randint(0, V, (N_,), device=device, generator=g)
            tag = f"logprob {name} N={N_} {str(dtype).split('.')[-1]}"
            h.requires_grad_()
            w.requires_grad_()
            if CHECKS:
                _check_logprob_case(tag, h, w, t, dtype, device)
            if TIMING and not past_deadline(tag):
                _time_logprob(tag, h, w, t, device, dry, peak, dtype, lp_mod)
            del h, w
            if device == "cuda":
                torch.cuda.empty_cache()


def _check_logprob_case(tag, h, w, t, dtype, device) -> None:
    import torch
    from alignopsd.kernels import logprob, logprob_loss_and_grad, logprob_ref

    N_ = h.shape[0]
    g = torch.Generator(device=device).manual_seed(1)
    lp, ent = logprob(h, w, t, with_entropy=True, impl="triton")
    z = h @ w.T
    ls = torch.log_softmax(z, -1)
    plain_lp = ls.gather(-1, t[:, None]).squeeze(-1)
    plain_ent = -(ls.exp() * ls).sum(-1)
    h32 = h.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    ref_lp, ref_ent = logprob_ref(h32, w32, t, with_entropy=True)
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    ok1, d1 = three_way(lp, plain_lp, ref_lp, atol)
    ok2, d2 = three_way(ent, plain_ent, ref_ent, atol)
    record(f"{tag} forward", ok1 and ok2, f"logp {d1}; entropy {d2}")
    gl = torch.randn(N_, device=device, generator=g)
    ge = torch.randn(N_, device=device, generator=g)
    ours = torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), [h, w])
    plain = torch.autograd.grad((plain_lp.float() * gl).sum() + (plain_ent.float() * ge).sum(), [h, w])
    ref = torch.autograd.grad((ref_lp * gl).sum() + (ref_ent * ge).sum(), [h32, w32])
    for gname, o, p, r in zip(("d_hidden", "d_weight"), ours, plain, ref):
        scale = float(r.abs().max())
        ok, d = three_way(o, p, r, (1e-5 if dtype == torch.float32 else 4e-3) * scale)
        record(f"{tag} {gname}", ok, d)
    fz = logprob_loss_and_grad(
        h.detach(), w.detach(), t, lambda a, e, i, gl=gl, ge=ge: a * gl[i] + e * ge[i], with_entropy=True
    )  # gradients formed with the log-probs (three matmuls), torch ops on the device
    for gname, o, p, r in zip(("d_hidden", "d_weight"), (fz.grad_hidden, fz.grad_weight), plain, ref):
        scale = float(r.abs().max())
        ok, d = three_way(o, p, r, (1e-5 if dtype == torch.float32 else 4e-3) * scale)
        record(f"{tag} fused-loss {gname}", ok, d)
    del fz
    del z, ls, plain_lp, plain_ent, ref_lp, ref_ent, ours, plain, ref, h32, w32, lp, ent
    if device == "cuda":
        torch.cuda.empty_cache()


def _time_logprob(tag, h, w, t, device, dry, peak, dtype, lp_mod) -> None:
    import torch
    from alignopsd.kernels import logprob, logprob_loss_and_grad

    N_, H = h.shape
    V = w.shape[0]
    # timing (no grad forward; forward + backward)
    hd, wd = h.detach(), w.detach()

    def ours_fwd():
        with torch.no_grad():
            return logprob(hd, wd, t, impl="triton")

    def base_fwd():
        with torch.no_grad():
            return torch.log_softmax(hd @ wd.T, -1).gather(-1, t[:, None])

    def ours_fb():
        h.grad = w.grad = None
        logprob(h, w, t, impl="triton").sum().backward()

    def base_fb():
        h.grad = w.grad = None
        torch.log_softmax(h @ w.T, -1).gather(-1, t[:, None]).sum().backward()

    def ours_fused():
        return logprob_loss_and_grad(hd, wd, t, lambda lp, _e, _i: lp)

    flops = 2.0 * N_ * H * V
    esize = h.element_size()
    bytes_ = (V * H + N_ * H) * esize
    modes = (
        ("fwd", ours_fwd, base_fwd, 1),
        ("fwd+bwd", ours_fb, base_fb, 4),
        ("fused-loss fwd+bwd", ours_fused, base_fb, 3),
    )
    for mode, fo, fb, nmm in modes:
        if past_deadline(f"{tag} {mode}"):
            return
        to, tb = bench_ms(fo, device), bench_ms(fb, device)
        fl = nmm * flops
        min_fl = (1 if mode == "fwd" else 3) * flops
        floor = max(min_fl / (peak[0] * 1e12), bytes_ * (1 if mode == "fwd" else 3) / (peak[1] * 1e9)) * 1e3
        time_row(
            f"{tag} {mode}",
            to,
            tb,
            f"{fl / to / 1e9:.0f} TFLOP/s achieved ({nmm} matmuls), floor {floor:.3f} ms "
            f"({min_fl / 1e12:.2f} TFLOP min, {bytes_ / 2**20:.0f} MiB read once)",
        )


def _turn_batch(tasks: int, rollouts: int, turns: int, D: int, *, seed: int):
    """Shuffled turns whose thinking embeddings cluster in 8 phases per task; a few invalid (CPU tensors)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    M = tasks * rollouts * turns
    task = torch.arange(tasks).repeat_interleave(rollouts * turns)
    roll = torch.arange(rollouts).repeat_interleave(turns).repeat(tasks)
    turn = torch.arange(turns).repeat(tasks * rollouts)
    proto = torch.nn.functional.normalize(torch.randn(tasks, 8, D, generator=g), dim=-1)
    phase = torch.randint(0, 8, (M,), generator=g)
    te = torch.nn.functional.normalize(proto[task, phase] + 0.5 * torch.randn(M, D, generator=g) / D**0.5, dim=-1)
    st = torch.nn.functional.normalize(proto[task, phase] + 0.5 * torch.randn(M, D, generator=g) / D**0.5, dim=-1)
    sv = torch.rand(M, generator=g) > 0.03
    tv = torch.rand(M, generator=g) > 0.03
    perm = torch.randperm(M, generator=g)
    return tuple(x[perm] for x in (te, st, task, roll, turn, sv, tv))


def check_alignment(device: str, dry: bool) -> None:
    import torch

    tasks, rollouts, turns, D = (16, 8, 50, 1024) if not dry else (2, 3, 5, 33)
    M = tasks * rollouts * turns
    batch = tuple(x.to(device) for x in _turn_batch(tasks, rollouts, turns, D, seed=0))
    if CHECKS:
        for dtype in (torch.float32, torch.bfloat16):
            _check_topk_case(f"sibling_topk M={M} D={D} {str(dtype).split('.')[-1]}", batch, dtype)
    if TIMING and not past_deadline(f"alignment M={M} D={D}"):
        _time_alignment(f"alignment M={M} D={D}", batch, device)


_TOPK_KW = dict(gamma=0.7, top_k=3, profile_temperature=0.1)


def _check_topk_case(tag: str, batch: tuple, dtype) -> None:
    import torch
    from alignopsd.kernels import DISTANCES, boundary_scores, sibling_topk

    import alignopsd

    te, st, task, roll, turn, sv, tv = batch
    cpu = lambda *xs: [x.cpu() for x in xs]  # noqa: E731  (the core's torch path runs on CPU tensors)
    tq, sq = te.to(dtype), st.to(dtype)
    out = sibling_topk(tq, sq, task, roll, turn, sv, tv, impl="triton", **_TOPK_KW)
    ref = sibling_topk(tq.float(), sq.float(), task, roll, turn, sv, tv, impl="torch", **_TOPK_KW)
    plain = (tq @ sq.T).float().clamp(-1, 1) * (task[:, None] == task[None, :]) * (sv[:, None] & tv[None, :])
    ok, d = three_way(out.H, plain, ref.H, 1e-6)
    record(f"{tag} H", ok, d)
    record(f"{tag} eligibility", bool(torch.equal(out.eligible, ref.eligible)), "exact")
    sel = alignopsd.select_sources(*cpu(out.H, out.eligible, task, roll, turn), gamma=0.7, top_k=3)
    record(f"{tag} selection == select_sources", out.selected_lists() == sel, f"{sum(map(len, sel))} pairs")
    P, valid = alignopsd.correspondence_profiles(*cpu(out.H, out.eligible), gamma=0.7, temperature=0.1)
    err = float((out.P.cpu() - P).abs().max())
    ok = err <= 1e-5 and bool(torch.equal(valid, out.profile_valid.cpu()))
    record(f"{tag} profiles", ok, f"max err {err:.1e}")
    for dist in DISTANCES:
        d_t, bv_t = boundary_scores(
            out.P, out.profile_valid, out.eligible, task, roll, turn, distance=dist, impl="triton"
        )
        d_c, bv_c = alignopsd.boundary_scores(
            *cpu(out.P, out.profile_valid, out.eligible, task, roll, turn), distance=dist
        )
        err = float((d_t.cpu() - d_c).abs().max())
        ok = err <= 1e-5 and bool(torch.equal(bv_t.cpu(), bv_c))
        record(f"{tag} boundary {dist}", ok, f"max err {err:.1e}")


def _time_alignment(tag: str, batch: tuple, device: str) -> None:
    from alignopsd.kernels import boundary_scores_blocks, sibling_topk

    import alignopsd
    from alignopsd.rectification import similarity_matrix

    te, st, task, roll, turn, sv, tv = batch

    def ours():
        r = sibling_topk(te, st, task, roll, turn, sv, tv, impl="triton", **_TOPK_KW)
        return boundary_scores_blocks(r.P_BTS, r.E_BTS, r.profile_valid, r.blocks, impl="triton")

    def base():
        r = sibling_topk(te, st, task, roll, turn, sv, tv, impl="torch", **_TOPK_KW)
        return boundary_scores_blocks(r.P_BTS, r.E_BTS, r.profile_valid, r.blocks, impl="torch")

    def core():
        H = similarity_matrix(te, st, task)
        E = alignopsd.eligibility(task, roll, sv, tv)
        alignopsd.select_sources(H, E, task, roll, turn, gamma=0.7, top_k=3)
        P, v = alignopsd.correspondence_profiles(H, E, gamma=0.7)
        return alignopsd.boundary_scores(P, v, E, task, roll, turn)

    to, tb, tc = bench_ms(ours, device), bench_ms(base, device), bench_ms(core, device)
    time_row(f"{tag} (triton vs torch path)", to, tb, "")
    time_row(f"{tag} (triton vs core dense)", to, tc, "the core dispatches to the kernels")


def check_core_dispatch(device: str, dry: bool) -> None:
    """The algorithm core on ``device`` tensors (CUDA: it routes to the Triton kernels by itself; dry run:
    forced with ``force_kernels()``) against the core on CPU tensors (its torch path): selections and
    segments exact, profiles and advantages within 1e-5."""
    import contextlib

    import torch
    from alignopsd.kernels import core_uses_kernels

    import alignopsd
    from alignopsd.credit import CreditConfig, allocate_credit
    from alignopsd.rectification import similarity_matrix
    from alignopsd.testing import force_kernels

    tasks, rollouts, turns, D, L = (16, 8, 50, 256, 64) if not dry else (2, 3, 6, 16, 5)
    te, st, task, roll, turn, sv, tv = _turn_batch(tasks, rollouts, turns, D, seed=1)
    g = torch.Generator().manual_seed(2)
    M = task.numel()
    mask = torch.rand(M, L, generator=g) < 0.8
    mask[:, 0] = True
    batch = dict(
        gap=torch.randn(M, L, generator=g),
        mask=mask,
        outcome=(torch.rand(tasks, rollouts, generator=g) < 0.5).float()[task, roll],
        task=task,
        rollout=roll,
        turn=turn,
        H=similarity_matrix(te, st, task),
        eligible=alignopsd.eligibility(task, roll, sv, tv),
    )
    ids = (task, roll, turn)
    cfg = CreditConfig(gamma=0.7)
    on_dev = {k: v.to(device) for k, v in batch.items()}
    dev_ids = tuple(on_dev[k] for k in ("task", "rollout", "turn"))
    tag = f"core dispatch M={M}"
    with force_kernels() if dry else contextlib.nullcontext():
        record(f"{tag} routes to the kernels", core_uses_kernels(on_dev["H"]), f"{device} tensors")
        sel = alignopsd.select_sources(on_dev["H"], on_dev["eligible"], *dev_ids, gamma=0.7, top_k=3)
        P, valid = alignopsd.correspondence_profiles(on_dev["H"], on_dev["eligible"], gamma=0.7)
        credit = allocate_credit(**on_dev, config=cfg)
    sel_c = alignopsd.select_sources(batch["H"], batch["eligible"], *ids, gamma=0.7, top_k=3)
    record(f"{tag} select_sources", sel == sel_c, f"{sum(map(len, sel_c))} pairs, exact")
    P_c, valid_c = alignopsd.correspondence_profiles(batch["H"], batch["eligible"], gamma=0.7)
    err = float((P.cpu() - P_c).abs().max())
    record(f"{tag} correspondence_profiles", err <= 1e-5 and bool(torch.equal(valid.cpu(), valid_c)), f"{err:.1e}")
    ref = allocate_credit(**batch, config=cfg)
    same = all(
        torch.equal(getattr(credit, k).cpu(), getattr(ref, k))
        for k in ("segment_index", "boundary_kind", "boundary_valid", "profile_valid")
    )
    err = max(
        float((getattr(credit, k).cpu() - getattr(ref, k)).abs().max())
        for k in ("advantage", "turn_weight", "token_advantage", "boundary_distance")
    )
    n_seg = int(ref.segment_index.max()) + 1
    detail = f"{n_seg} spans {'equal' if same else 'DIFFER'}, max err {err:.1e}, tau {credit.threshold:.4g}"
    record(f"{tag} allocate_credit", same and err <= 1e-5 and abs(credit.threshold - ref.threshold) <= 1e-6, detail)


PARTS = ("configs", "kernels", "engine", "scale", "timing")


def _parse(argv):
    ap = argparse.ArgumentParser(description="Check the Triton kernels and the training engine on a GPU.")
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes (no GPU needed)")
    ap.add_argument("--skip-timing", action="store_true", help="correctness checks only")
    ap.add_argument("--part", choices=("all", *PARTS), default="all", help="run one part (default: all in turn)")
    ap.add_argument("--out", default=None, help="append every line to this results file as it is known")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which engine cases / timings skip")
    ap.add_argument("--steps", type=int, default=None, help="training steps per estimator (default 2; dry run 1)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--peak-gbps", type=float, default=None)
    return ap.parse_args(argv)


def _run_part(part: str, device: str, args, peak: tuple[float, float]) -> None:
    global CHECKS, TIMING, DEADLINE
    budget = args.budget if args.budget is not None else math.inf
    DEADLINE = time.perf_counter() + budget
    if part == "configs":
        from bench.gpu_configs import run_configs

        for name, ok, detail in run_configs(device, args.dry_run, emit, bench_ms, past_deadline):
            record(name, ok, detail)
        return
    if part in ("kernels", "timing"):
        CHECKS, TIMING = part == "kernels", part == "timing"
        if TIMING:
            emit("| check | time ours (ms) | time torch (ms) | speedup | notes |\n|---|---:|---:|---:|---|")
        check_logprob(device, args.dry_run, peak)
        check_alignment(device, args.dry_run)
        if CHECKS:
            check_core_dispatch(device, args.dry_run)
        return
    from bench.gpu_engine_check import run_engine, run_scale

    if part == "engine":
        steps = args.steps or (1 if args.dry_run else 2)
        out = run_engine(device, args.dry_run, emit, steps=steps, budget_s=budget)
    else:
        out = [run_scale(device, args.dry_run, emit)]
    for r in out:
        RESULTS.append((f"engine {r['name']}", r["ok"], r.get("detail", "")))


def main(argv=None) -> int:
    global _OUT
    args = _parse(argv)
    _setup_imports(args.dry_run)
    RESULTS.clear()
    import torch
    import transformers
    import triton

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter check", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    peaks = peak_table()
    key = next((k for k in peaks if k in name.lower()), None)
    peak = peaks.get(key, (100.0, 1000.0))
    peak = (args.peak_tflops or peak[0], args.peak_gbps or peak[1])
    parts = [p for p in (PARTS if args.part == "all" else (args.part,)) if p != "timing" or not args.skip_timing]
    _OUT = open(args.out, "a") if args.out else None  # noqa: SIM115  (closed below)
    try:
        for part in parts:
            t0 = time.perf_counter()
            n0 = len(RESULTS)
            emit(
                f"\n## {part}: {name}; torch {torch.__version__}, triton {triton.__version__}, "
                f"transformers {transformers.__version__}"
            )
            if part == "timing":
                emit(f"peak assumed: {peak[0]:.0f} TFLOP/s, {peak[1]:.0f} GB/s\n")
            torch.manual_seed(0)
            _run_part(part, device, args, peak)
            mine = RESULTS[n0:]
            bad = sum(not r[1] for r in mine)
            emit(f"\n{part}: {len(mine) - bad}/{len(mine)} checks passed in {time.perf_counter() - t0:.0f} s")
    finally:
        if _OUT is not None:
            _OUT.close()
            _OUT = None
    return 1 if any(not r[1] for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())

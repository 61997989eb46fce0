"""Launch configurations of the Triton kernels per GPU architecture, autotuning, and their roofline bounds.

Each kernel has a small set of configurations per architecture (sm_80: A100 / A800; sm_90: H100 / H200). Every
one of them compiles without register spills (no local memory) for bf16 and fp16 operands on both
architectures, and within the per-block shared memory limit for fp32 too; ``python -m bench.kernel_compile`` proves it
ahead of time on a machine without a GPU and writes the table (registers, local bytes, shared bytes,
occupancy) to ``bench/results/``.

Which configuration runs:

- CUDA, autotuning on (the default): ``triton.autotune`` benchmarks the architecture's set once per key and
  keeps the fastest. Keys: the log-prob kernels ``(V, H)`` (vocabulary, hidden size), the sibling kernel ``D``
  (encoder / head dimension); the profile and pair kernels have no dimension worth re-tuning for (they are
  bandwidth-bound row sweeps) and tune once per process. The backward's gradient buffers are reset to zero
  between the benchmark runs (it accumulates with atomics).
- CUDA with ``ALIGNOPSD_AUTOTUNE=0``, and the Triton interpreter (CPU tests; triton's autotuner times on a GPU
  clock, which the interpreter has not): the first configuration of the set, the documented default.

Configurations (BLOCK sizes, warps ``w``, pipeline stages ``s``); the first is the default:

=================  =============================================  =============================================
kernel             sm_80 (A800)                                   sm_90 (H200)
=================  =============================================  =============================================
log-prob forward   N64 V128 H64 w8 s3; N64 V64 H64 w4 s3;         N64 V128 H64 w8 s3; N64 V128 H64 w8 s4;
                   N32 V128 H64 w4 s3; N64 V128 H64 w8 s4         N64 V64 H64 w4 s3; N32 V128 H64 w4 s3
log-prob backward  N64 V128 H32 w8 s3; N64 V64 H32 w4 s3;         N64 V128 H32 w8 s3; N64 V128 H64 w8 s3;
                   N64 V128 H64 w8 s3; N128 V64 H64 w8 s3         N64 V64 H32 w4 s3; N128 V64 H64 w8 s3
sibling            T32 S32 D64 w4 s3; T32 S32 D64 w4 s2;          same
                   T16 S32 D64 w4 s2; T32 S32 D128 w4 s2
profiles           T32 S32 w4; T16 S64 w4; T64 S32 w8             same
pair (JSD)         BLOCK 128 w4; BLOCK 256 w4; BLOCK 512 w8       same
=================  =============================================  =============================================

fp32 operands (exact "ieee" dots, which the tensor cores do not run: the product is done on FMA units with the
operands held in registers) spill in the log-prob kernels with every configuration here: 16-840 bytes per
thread in the forward, 16-4,592 in the backward (the table has each). The engine trains in bf16 on GPUs; fp32
runs on CUDA are correct but slower than the bound by more than the spills.

With a hidden size, vocabulary or row stride that is not a multiple of 16 (none of the Qwen2.5 or SmolLM2 heads),
triton cannot vectorize the loads and registers rise: the forward default then spills 16 bytes per thread on
sm_80 (none on sm_90), the backward default none; the other configurations spill up to 1,024 bytes (the table's
``unaligned`` rows, which the check reports without failing).

The former single configuration of the log-prob kernels (N64 V128 H64, 4 warps, 3 stages) spills in bf16: 255
registers and 8 bytes of local memory per thread in the forward on sm_90, 255 registers and 680 bytes in the
backward on sm_80 (with 16-byte aligned shapes; with unaligned ones 168 registers and 1,304 bytes in the
forward on sm_80). Twice the warps for the same tile halve the accumulator's registers per thread and remove
the spill; the backward also halves its hidden-size step (H32), which its three live tiles need.

Roofline (bf16 operands, fp32 accumulation; :func:`roofline` computes these; A800: 312 TFLOP/s dense bf16,
2.039 TB/s HBM; H200: 989 TFLOP/s, 4.8 TB/s). Shapes: Qwen2.5-3B head H 2048, V 151,936 and 7B head H 3584,
V 152,064, N = 8,192 tokens per launch; sibling: 16 tasks x (G=8 x 50 turns = 400 slots), D = 1,024.

=====================================  ==========  ============  ==========  ==========
kernel, shape                          GFLOP       MB moved      A800 (ms)   H200 (ms)
=====================================  ==========  ============  ==========  ==========
log-prob fwd, 3B (AI 7,771 FLOP/B)     5,098       656           16.3        5.16
log-prob fwd, 7B (AI 7,772 FLOP/B)     8,929       1,149         28.6        9.03
log-prob bwd, 3B (AI 94 FLOP/B)        15,294      163,118       80.0        34.0
log-prob bwd, 7B (AI 94 FLOP/B)        26,788      285,696       140         59.5
sibling (AI 213 FLOP/B)                10.5        49.3          0.034       0.011
profiles (bytes only)                  0           35.8          0.018       0.0075
pair (JSD), 6,400 row pairs            0           25.6          0.013       0.0053
=====================================  ==========  ============  ==========  ==========

The forward is compute-bound (arithmetic intensity near N, far above the ridge of 153 FLOP/B on the A800
and 206 on the H200): its bound is the bf16 matmul peak, given that the row tiles of one vocabulary split run
together and share the weight tiles in L2 (grid axis 0 is the row tile). The backward is bound by its fp32
atomic adds into d hidden: one read-modify-write of the [N, H] buffer (67-117 MB, more than L2) per vocabulary
tile, V / BLOCK_V of them; the adds into d W meet in L2 (the row tiles of a vocabulary tile run together). Its
intensity is about 6 BLOCK_V / 8 FLOP/B, below both ridges at BLOCK_V = 128. BLOCK_V 256 would double it, but
N64 V256 H32 w8 spills 8 bytes per thread on sm_80 in bf16 / fp16 (223 registers, no spill, on sm_90), and the
forward's N64 V256 H64 w8 spills 8 bytes on sm_90, so the sets stay at 128 (bound above: 80 / 34 ms for the 3B
head; at V256 the estimate would be 49 / 17 ms). A d hidden computed by a second kernel over vocabulary
tiles without atomics would remove that traffic. The sibling kernel (two passes of 2 N^2 D FLOPs per task)
sits at the ridge on both GPUs; the profile and pair sweeps are bandwidth-bound.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from alignopsd.kernels._dispatch import HAS_TRITON, interpret_mode, jit, launch

__all__ = [
    "ARCHS",
    "CONFIGS",
    "GPUS",
    "KernelConfig",
    "RESET_TO_ZERO",
    "arch_of",
    "autotune_enabled",
    "autotune_results",
    "configs_for",
    "default_config",
    "launch_tuned",
    "max_meta",
    "roofline",
]

ARCHS = (80, 90)


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: the kernel's BLOCK constexprs, warps and pipeline stages."""

    meta: dict[str, int] = field(hash=False)
    num_warps: int = 4
    num_stages: int = 3

    def label(self) -> str:
        blocks = " ".join(f"{k.replace('BLOCK_', '') or 'BLOCK'}{v}" for k, v in self.meta.items())
        return f"{blocks} w{self.num_warps} s{self.num_stages}"


def _c(num_warps: int, num_stages: int, **meta: int) -> KernelConfig:
    return KernelConfig(meta, num_warps, num_stages)


_SIBLING = [
    _c(4, 3, BLOCK_T=32, BLOCK_S=32, BLOCK_D=64),
    _c(4, 2, BLOCK_T=32, BLOCK_S=32, BLOCK_D=64),
    _c(4, 2, BLOCK_T=16, BLOCK_S=32, BLOCK_D=64),
    _c(4, 2, BLOCK_T=32, BLOCK_S=32, BLOCK_D=128),
]
_PROFILES = [_c(4, 3, BLOCK_T=32, BLOCK_S=32), _c(4, 3, BLOCK_T=16, BLOCK_S=64), _c(8, 3, BLOCK_T=64, BLOCK_S=32)]
_PAIR = [_c(4, 3, BLOCK=128), _c(4, 3, BLOCK=256), _c(8, 3, BLOCK=512)]

# kernel name -> architecture -> configurations (first = default). Names are the kernels' function names.
CONFIGS: dict[str, dict[int, list[KernelConfig]]] = {
    "_lp_fwd_kernel": {
        80: [
            _c(8, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),
            _c(4, 3, BLOCK_N=64, BLOCK_V=64, BLOCK_H=64),
            _c(4, 3, BLOCK_N=32, BLOCK_V=128, BLOCK_H=64),
            _c(8, 4, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),
        ],
        90: [
            _c(8, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),
            _c(8, 4, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),
            _c(4, 3, BLOCK_N=64, BLOCK_V=64, BLOCK_H=64),
            _c(4, 3, BLOCK_N=32, BLOCK_V=128, BLOCK_H=64),
        ],
    },
    "_lp_bwd_kernel": {
        80: [
            _c(8, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=32),
            _c(4, 3, BLOCK_N=64, BLOCK_V=64, BLOCK_H=32),
            _c(8, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),
            _c(8, 3, BLOCK_N=128, BLOCK_V=64, BLOCK_H=64),
        ],
        90: [
            _c(8, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=32),
            _c(8, 3, BLOCK_N=64, BLOCK_V=128, BLOCK_H=64),
            _c(4, 3, BLOCK_N=64, BLOCK_V=64, BLOCK_H=32),
            _c(8, 3, BLOCK_N=128, BLOCK_V=64, BLOCK_H=64),
        ],
    },
    "_sibling_kernel": {80: _SIBLING, 90: _SIBLING},
    "_profiles_kernel": {80: _PROFILES, 90: _PROFILES},
    "_pair_kernel": {80: _PAIR, 90: _PAIR},
}

# autotuning keys (argument names) and buffers the autotuner must zero between its benchmark runs
_KEYS = {"_lp_fwd_kernel": ["V", "H"], "_lp_bwd_kernel": ["V", "H"], "_sibling_kernel": ["D"]}
RESET_TO_ZERO = {"_lp_bwd_kernel": ["dh_ptr", "dw_ptr", "db_ptr"]}

_TUNERS: dict[tuple[str, int], Any] = {}


def arch_of(device: torch.device | None) -> int:
    """The configuration set of ``device``: 90 for compute capability 9.x and up, 80 otherwise (and on CPU)."""
    if device is not None and device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return 90 if major >= 9 else 80
    return 80


def configs_for(name: str, arch: int) -> list[KernelConfig]:
    """The configurations of kernel ``name`` for architecture ``arch`` (80 or 90)."""
    if name not in CONFIGS:
        raise ValueError(f"kernel: unknown name {name!r}; known: {', '.join(sorted(CONFIGS))}")
    if arch not in CONFIGS[name]:
        raise ValueError(f"arch: {arch!r} not in {ARCHS}")
    return CONFIGS[name][arch]


def default_config(name: str, arch: int = 80) -> KernelConfig:
    """The configuration used when autotuning is off (and in the interpreter): the set's first."""
    return configs_for(name, arch)[0]


def max_meta(name: str, key: str) -> int:
    """The largest value of constexpr ``key`` over all configurations of ``name`` (all architectures)."""
    return max(c.meta[key] for per_arch in CONFIGS[name].values() for c in per_arch)


def autotune_enabled() -> bool:
    """Autotuning runs on CUDA unless ``ALIGNOPSD_AUTOTUNE`` is 0/false/off; never in the interpreter."""
    flag = os.environ.get("ALIGNOPSD_AUTOTUNE", "1").strip().lower()
    return HAS_TRITON and not interpret_mode() and flag not in ("0", "false", "off", "no")


def _tuner(fn: Callable, arch: int) -> Any:
    import triton

    key = (fn.__name__, arch)
    tuner = _TUNERS.get(key)
    if tuner is None:
        configs = [
            triton.Config(dict(c.meta), num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs_for(fn.__name__, arch)
        ]
        tuner = triton.autotune(configs, key=_KEYS.get(fn.__name__, []), reset_to_zero=RESET_TO_ZERO.get(fn.__name__))(
            jit(fn)
        )
        _TUNERS[key] = tuner
    return tuner


def launch_tuned(
    fn: Callable, grid: Callable[[dict[str, int]], tuple[int, ...]], device: torch.device, *args: Any, **kwargs: Any
) -> None:
    """Launch kernel ``fn`` (a plain function) with its configuration: autotuned on CUDA, the default otherwise.

    ``grid(meta)`` gives the launch grid from the chosen configuration's BLOCK constexprs; ``kwargs`` are the
    kernel's other constexprs.
    """
    arch = arch_of(device)
    if device.type == "cuda" and autotune_enabled():
        _tuner(fn, arch)[grid](*args, **kwargs)
        return
    cfg = default_config(fn.__name__, arch)
    launch(fn, grid(cfg.meta), *args, **kwargs, **cfg.meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# --------------------------------------------------------------------------------------------------------------
# roofline
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    name: str
    arch: int
    tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    tbps: float  # HBM bandwidth, TB/s


GPUS = {"a800": GPU("A800", 80, 312.0, 2.039), "h200": GPU("H200", 90, 989.0, 4.8)}


def _traffic(kernel: str, shape: Sequence[int], elt: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one launch of ``kernel`` at ``shape``; ``elt``: bytes per operand element."""
    if kernel == "_lp_fwd_kernel":  # shape (N, V, H): one matmul; weights + hidden read once, 4 fp32 partials
        N, V, H = shape
        return 2.0 * N * V * H, elt * (V * H + N * H) + 16.0 * N
    if kernel == "_lp_bwd_kernel":  # recompute + d hidden + d W, fp32 atomic adds (read + write of 4 bytes)
        N, V, H = shape
        col_tiles = -(-V // 128)  # BLOCK_V of the default configuration
        # d W: the row tiles of one vocabulary tile run together (grid axis 0), their adds meet in L2: once.
        # d hidden: one add of [N, H] per vocabulary tile, a buffer larger than L2 at these shapes: to HBM.
        atomics = 8.0 * (V * H + col_tiles * N * H)
        return 6.0 * N * V * H, 2 * elt * (V * H + N * H) + atomics
    if kernel == "_sibling_kernel":  # shape (T, N, D): two passes of 2 N^2 D per task; H, P fp32 + E int8 out
        T, N, D = shape
        return 4.0 * T * N * N * D, 2.0 * elt * T * N * D + 9.0 * T * N * N
    if kernel == "_profiles_kernel":  # (T, N): H, E read twice, P written
        T, N = shape
        return 0.0, 10.0 * T * N * N + 4.0 * T * N * N
    if kernel == "_pair_kernel":  # (K, N): two rows of P (fp32) and E (int8) per pair
        K, N = shape
        return 0.0, 10.0 * K * N
    raise ValueError(f"kernel: unknown name {kernel!r}")


def roofline(kernel: str, shape: Sequence[int], gpu: str, elt: int = 2) -> dict[str, float]:
    """FLOPs, bytes, arithmetic intensity (FLOP/B) and the roofline time bound (ms) of one launch on ``gpu``."""
    if gpu not in GPUS:
        raise ValueError(f"gpu: unknown {gpu!r}; known: {', '.join(GPUS)}")
    g = GPUS[gpu]
    flops, nbytes = _traffic(kernel, shape, elt)
    bound_s = max(flops / (g.tflops * 1e12), nbytes / (g.tbps * 1e12))
    return {"flops": flops, "bytes": nbytes, "intensity": flops / nbytes, "bound_ms": bound_s * 1e3}


def autotune_results(name: str, arch: int) -> tuple[str | None, list[tuple[str, float]]]:
    """After an autotuned launch of kernel ``name`` on ``arch``: the chosen configuration's label and the
    milliseconds the autotuner measured for each configuration of its last tuning (``(None, [])`` before any)."""
    tuner = _TUNERS.get((name, arch))
    if tuner is None:
        return None, []

    def label(c: Any) -> str:
        return KernelConfig(dict(c.kwargs), c.num_warps, c.num_stages).label()

    timings = getattr(tuner, "configs_timings", None) or {}
    rows = [(label(c), float(t[0] if isinstance(t, (list, tuple)) else t)) for c, t in timings.items()]
    best = getattr(tuner, "best_config", None)
    return (label(best) if best is not None else None), rows

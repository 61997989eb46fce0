"""Which custom CPU path a process takes: the faster one, measured on this CPU, dtype and shape, not a CPU flag.

The C++ kernels (the LM head's bf16 partials, ``head/cpu_partials.py``; the shared-prefix prefill attention,
``attention_native.py``) run on any x86 CPU with AVX512-BF16, but being able to run is not being faster: on a Xeon with
AMX, torch's own paths reach more than the head kernel (torch's fp32 matmul 270 GFLOP/s, the kernel 211, on
``[3800, 576] x [49152, 576]``). So each kernel is taken only where it was measured faster than the torch path it
replaces, here, in the operands' dtype and at the run's shape, once per process:

- :func:`measure` times both paths on the same operands (``timer``: the best of at least two calls each after a
  warm-up, more for a probe of a few milliseconds) and records a :class:`KernelChoice`; a caller does this once
  before its first real call, at its own shapes (a training run states the result in its first lines);
- the kernels' routing (``_dispatch.resolve_impl`` with a ``NativePath``) takes a kernel only when it can run and
  the recorded choice says it is faster. A kernel asked before anything was measured is measured then, on its first
  real operands (the path's ``measure``), so no path is ever taken on a flag alone.

The same rule picks the LM head's GEMMs on bf16 operands with fp32 results (``HEAD_GEMM``, ``head/bf16_gemm.py``: the
forward's logits tiles and the backward's two GEMMs) against fp32 tiles of upcast weights.

These are this package's own per-shape choices, kept for the process as Triton's autotune cache keeps its configs.
A caller that runs several processes can hand one process's choices to the others (:func:`choices_state`,
:func:`restore_choices`), and store them to take them again later, so every process computes alike.
``ALIGNOPSD_CPU_PATHS=torch`` measures nothing and takes the torch paths everywhere (:func:`pinned`: the test
suite's setting, and a user's for bit-identical reruns).

The same rule picks the fused element-wise work of the Llama layers (``RMS_NORM``, ``SWIGLU``, ``ROTARY``:
``fused_ops.py``, compiled with ``torch.compile``) against the stock Hugging Face modules, forward and backward, in
any dtype.

A choice is recorded per name (``HEAD``, ``HEAD_GEMM``, ``ATTENTION``, ``FUSED_OPS``); the choice a test or a check
wants is recorded with :func:`record` (``alignopsd.testing`` re-exports it with :func:`forget`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

HEAD = "head partials"  # kernels/head/cpu_partials.py against head/torch_tiles.torch_partials
HEAD_GEMM = "head GEMMs"  # kernels/head/bf16_gemm.py: bf16 operands, fp32 results, against fp32 tiles of upcast weights
ATTENTION = "prefix attention"  # kernels/attention_native.py against decode_cache's gathered sdpa
# a Llama layer's work between its GEMMs, forward and backward, compiled (kernels/fused_ops.py), against the stock code
RMS_NORM, SWIGLU, ROTARY = "fused RMSNorm", "fused SwiGLU", "fused rotary"
FUSED_OPS = (RMS_NORM, SWIGLU, ROTARY)
KERNELS = (HEAD, HEAD_GEMM, ATTENTION, *FUSED_OPS)
# what each choice's two sides are called in the run's log: (the custom path, the path it replaces)
LABELS = {HEAD_GEMM: ("bf16 GEMM", "fp32 tiles"), **{op: ("compiled", "stock module") for op in FUSED_OPS}}


@dataclass(frozen=True)
class KernelChoice:
    """The measured choice of one custom kernel: ``native`` when it was faster than the torch path."""

    kernel: str
    native: bool
    native_s: float | None  # seconds of the kernel on the probe (None: it could not run here)
    torch_s: float | None  # seconds of the torch path on the same probe
    shape: str  # the probe's operands, e.g. "[256, 576] x [49152, 576] bf16"
    flops: float = 0.0  # FLOPs of one call at ``shape`` (0: not counted), for the rates in :meth:`describe`
    why: str = ""  # why the kernel could not run, when ``native_s`` is None

    def describe(self) -> str:
        """One line for the run's log, e.g. ``head partials: torch path (71.0 ms, 110 GFLOP/s) over C++ kernel
        (83.0 ms, 94 GFLOP/s) at [256, 576] x [32768, 576] bfloat16``."""
        custom, plain = LABELS.get(self.kernel, ("C++ kernel", "torch path"))
        pick, other = (custom, plain) if self.native else (plain, custom)
        if self.why or self.native_s is None or self.torch_s is None:
            return f"{self.kernel}: {pick} ({self.why or 'not measured'})"
        fast, slow = (self.native_s, self.torch_s) if self.native else (self.torch_s, self.native_s)
        rates = f"{pick} ({_rate(fast, self.flops)}) over {other} ({_rate(slow, self.flops)})"
        return f"{self.kernel}: {rates} at {self.shape}"


def _rate(seconds: float | None, flops: float) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" + (f", {flops / seconds / 1e9:.0f} GFLOP/s" if flops else "")


_CHOICES: dict[str, KernelChoice] = {}
PIN_ENV = "ALIGNOPSD_CPU_PATHS"  # "torch": every choice is the torch path, nothing is measured


def pinned() -> str:
    """Why nothing is measured in this process ("" when choices are measured): ``ALIGNOPSD_CPU_PATHS=torch`` takes
    the torch paths everywhere (a caller's own measured choices may read it too), so two runs of one config on one
    machine compute bit-identically (a measured choice may differ between processes; a resumed run takes its
    checkpoint's, so resuming is exact either way)."""
    value = os.environ.get(PIN_ENV, "")
    if value not in ("", "torch", "measured"):
        raise ValueError(f"{PIN_ENV}: expected 'torch' or 'measured', got {value!r}")
    return f"{PIN_ENV}=torch" if value == "torch" else ""


def choices_state() -> dict[str, bool]:
    """The choices recorded in this process, by name: True for the custom path (what a checkpoint stores)."""
    return {k: c.native for k, c in sorted(_CHOICES.items())}


def restore_choices(state: dict, why: str) -> list[KernelChoice]:
    """Record the choices of ``state`` (:func:`choices_state` of another process: rank 0, or the run that wrote a
    checkpoint), replacing this process's; unknown names are refused, missing ones keep what was recorded."""
    out = []
    for kernel, native in state.items():
        if kernel not in KERNELS or not isinstance(native, bool):
            raise ValueError(f"paths: unknown choice {kernel!r}: {native!r} (known: {', '.join(KERNELS)})")
        out.append(record(KernelChoice(kernel, native, None, None, "", why=why)))
    return out


def record(choice: KernelChoice) -> KernelChoice:
    """Keep ``choice`` for the rest of the process (a later measurement of the same kernel replaces it)."""
    if choice.kernel not in KERNELS:
        raise ValueError(f"kernel: unknown custom kernel {choice.kernel!r}; known: {', '.join(KERNELS)}")
    _CHOICES[choice.kernel] = choice
    return choice


def recorded(kernel: str) -> KernelChoice | None:
    """The choice recorded for ``kernel`` in this process, if any."""
    return _CHOICES.get(kernel)


def forget(kernel: str | None = None) -> None:
    """Drop the recorded choice of ``kernel`` (every kernel's when None): the next use measures again."""
    if kernel is None:
        _CHOICES.clear()
    else:
        _CHOICES.pop(kernel, None)


def best_seconds(fn: Callable[[], object], reps: int = 2, min_time: float = 0.1, max_reps: int = 20) -> float:
    """The fastest timed call of ``fn`` after one untimed call (allocation, first-touch): at least ``reps`` calls,
    more while they add up to less than ``min_time`` seconds (a probe of a few milliseconds is timed often enough
    that one slow call of a busy machine does not decide), at most ``max_reps``."""
    fn()
    best, spent, n = float("inf"), 0.0, 0
    while n < reps or (spent < min_time and n < max_reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def measure(
    kernel: str,
    native: Callable[[], object] | None,
    torch_path: Callable[[], object],
    shape: str,
    *,
    flops: float = 0.0,
    why: str = "",
    timer: Callable[[Callable[[], object]], float] | None = None,
) -> KernelChoice:
    """Time ``native`` (None: the kernel cannot run here, ``why`` says why) and ``torch_path`` on the same operands
    (``timer``, by default :func:`best_seconds`) and record the choice: the kernel is taken only when it was strictly
    faster."""
    timer = timer or best_seconds
    if pinned():
        return record(KernelChoice(kernel, False, None, None, shape, flops, pinned()))
    if native is None:
        return record(KernelChoice(kernel, False, None, None, shape, flops, why or "the C++ kernel cannot run here"))
    native_s, torch_s = timer(native), timer(torch_path)
    return record(KernelChoice(kernel, native_s < torch_s, native_s, torch_s, shape, flops))

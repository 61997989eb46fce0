"""A device's limits: the FLOP/s and bytes/s its work can reach, and the time a phase's work needs at them.

- **GPUs**: the vendor peaks of :data:`GPU_PEAKS` (dense bf16 tensor-core FLOP/s and HBM bandwidth, from the
  datasheets cited there; bench/gpu_check.py reads the same table), optionally with measured probes.
- **CPUs** (and a GPU that is present): :func:`calibrate` measures, in the model's dtype with the threads the
  run uses, the GEMMs of the model's MLP (``[M, hidden] x [hidden, intermediate]`` and the down projection, the
  better of the two; for bf16 on a CPU also the engine's own C++ bf16 GEMM and the bf16 GEMM with fp32 results of
  the LM head, where they run: the limit is the fastest GEMM this CPU offers in that dtype, torch's AMX path
  included) for several row counts M
  (decoding multiplies a few rows by every weight; prefill and training many), and a read-bandwidth probe (a sum) over
  a buffer larger than the last-level cache. The results name the device and the numbers used.

:func:`part_seconds` is the roofline time of one :class:`~alignopsd.engine.lab.cost_model.Part`:
compute parts at the GEMM rate of large M, decoding at ``max(FLOPs / rate(M = rows), bytes / bandwidth)``,
the optimizer at the bandwidth; ``compute_fraction`` and ``bandwidth_fraction`` scale the limits (1 for the
measured probes, a stated fraction of a vendor peak for a plan).
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

import torch
from alignopsd.engine.lab.cost_model import Part, PhaseWork

# name -> (dense bf16 TFLOP/s, HBM GB/s, source). A800 = A100 SXM 80GB compute and memory (its NVLink is capped
# at 400 GB/s, which this model does not use).
GPU_PEAKS: dict[str, tuple[float, float, str]] = {
    "a800": (312.0, 2039.0, "NVIDIA A100 datasheet (SXM 80GB: 312 TFLOPS BF16 dense, 2,039 GB/s); A800 = A100 "
                            "with NVLink capped at 400 GB/s"),
    "a100": (312.0, 2039.0, "NVIDIA A100 datasheet (SXM 80GB: 312 TFLOPS BF16 dense, 2,039 GB/s)"),
    "h100": (989.0, 3350.0, "NVIDIA H100 datasheet (SXM: 989 TFLOPS BF16 dense, 3.35 TB/s)"),
    "h200": (989.0, 4800.0, "NVIDIA H200 datasheet (SXM: 989 TFLOPS BF16 dense, 4.8 TB/s)"),
    "l40s": (362.0, 864.0, "NVIDIA L40S datasheet (362 TFLOPS BF16 dense, 864 GB/s)"),
}  # fmt: skip
GEMM_ROWS = (1, 4, 16, 64, 256, 1024)  # calibrated row counts M


@dataclass
class DeviceLimits:
    name: str
    flops: dict[int, float]  # achievable FLOP/s by GEMM rows M (one entry: the same at every M)
    bytes_per_s: float
    source: str
    threads: int = 0
    dtype: str = ""
    probes: dict[str, float] = field(default_factory=dict)  # seconds of each probe, for the record

    def flops_at(self, rows: float) -> float:
        """FLOP/s of a GEMM with ``rows`` rows: the best rate calibrated at M <= rows (a GEMM of more rows can be cut
        into those); 0 rows: the best rate at any M. Below every calibrated M: the smallest M's rate."""
        keys = sorted(self.flops)
        below = keys if rows <= 0 else [m for m in keys if m <= rows]
        return max(self.flops[m] for m in below) if below else self.flops[keys[0]]

    @property
    def peak_flops(self) -> float:
        return max(self.flops.values())

    def describe(self) -> str:
        rates = ", ".join(f"M={m}: {v / 1e9:.0f}" for m, v in sorted(self.flops.items()))
        extra = f"; {self.threads} threads, {self.dtype}" if self.threads else ""
        return f"{self.name}: GFLOP/s {rates}; {self.bytes_per_s / 1e9:.1f} GB/s ({self.source}{extra})"


def gpu_limits(name: str) -> DeviceLimits:
    """Vendor peaks of GPU ``name`` (a key of :data:`GPU_PEAKS`, or a device name containing one)."""
    key = gpu_key(name)
    if key is None:
        raise ValueError(f"--gpu: unknown GPU {name!r}; allowed: {', '.join(GPU_PEAKS)}")
    tf, gbs, src = GPU_PEAKS[key]
    return DeviceLimits(key.upper(), {0: tf * 1e12}, gbs * 1e9, f"vendor peak: {src}")


def gpu_key(name: str) -> str | None:
    low = str(name).lower()
    return low if low in GPU_PEAKS else next((k for k in GPU_PEAKS if k in low), None)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _best(fn, device: torch.device, min_time: float, max_reps: int) -> float:
    """Best seconds of ``fn`` over repetitions lasting at least ``min_time`` in all (at most ``max_reps``)."""
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < max_reps and (spent < min_time or reps < 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def calibrate(
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    rows: tuple[int, ...] = GEMM_ROWS,
    bandwidth_bytes: int = 256 << 20,
    min_time: float = 0.2,
    max_reps: int = 50,
) -> DeviceLimits:
    """Measured GEMM FLOP/s at each M of ``rows`` (``[M, hidden] x [hidden, intermediate]`` in ``dtype``) and read
    bandwidth (a sum over ``bandwidth_bytes`` of ``dtype``), with the threads torch uses now."""
    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    flops, probes = {}, {}
    with torch.no_grad():
        for k, n in ((hidden, intermediate), (intermediate, hidden)):  # the MLP's up and down projections
            w = torch.randn(k, n, generator=g).to(dev, dtype)
            for m in rows:
                x = torch.randn(m, k, generator=g).to(dev, dtype)
                s = _best(lambda x=x, w=w: torch.mm(x, w), dev, min_time, max_reps)
                flops[m] = max(flops.get(m, 0.0), 2.0 * m * k * n / s)
                probes[f"gemm M={m} K={k}"] = s
        if dev.type == "cpu" and dtype == torch.bfloat16:  # the engine's own bf16 GEMMs, where they run
            _native_gemm(hidden, intermediate, max(rows), g, flops, probes, min_time, max_reps)
            _fp32_result_gemm(hidden, intermediate, max(rows), g, flops, probes, min_time, max_reps)
        esize = torch.empty((), dtype=dtype).element_size()
        buf = torch.ones(bandwidth_bytes // esize, dtype=dtype, device=dev)
        s = _best(lambda: buf.sum(), dev, min_time, max_reps)  # native accumulation: no conversion pass
        probes["read"] = s
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    where = (
        f"measured: best of the GEMMs [M, {hidden}] x [{hidden}, {intermediate}] and its transpose"
        + (" and the C++ bf16 kernel" if any(k.startswith("native") for k in probes) else "")
        + (" and the bf16 GEMM with fp32 results" if any(k.startswith("bf16 gemm") for k in probes) else "")
        + f", read of {bandwidth_bytes >> 20} MiB"
    )
    return DeviceLimits(
        name, flops, buf.numel() * esize / s, where, torch.get_num_threads(), str(dtype).removeprefix("torch."), probes
    )


def _native_gemm(hidden, intermediate, m, g, flops, probes, min_time, max_reps) -> None:
    """The C++ head kernel's rate on ``[m, hidden] x [intermediate, hidden]`` (bf16 products, fp32 accumulation,
    its online logsumexp counted as nothing) where it can run: on a CPU with AVX512-BF16 and no AMX it is the
    fastest bf16 GEMM the engine has, faster than torch's, so the limit must include it."""
    from alignopsd.kernels.cpp import native_ready
    from alignopsd.kernels.head.cpu_partials import native_partials

    if not native_ready():
        return
    h = torch.randn(m, hidden, generator=g).bfloat16()
    w = (torch.randn(intermediate, hidden, generator=g) * hidden**-0.5).bfloat16()
    t = torch.zeros(m, dtype=torch.long)
    s = _best(lambda: native_partials(h, w, t, 1.0, 0, need_u=False), torch.device("cpu"), min_time, max_reps)
    probes[f"native head M={m} K={hidden}"] = s
    flops[m] = max(flops.get(m, 0.0), 2.0 * m * hidden * intermediate / s)


def _fp32_result_gemm(hidden, intermediate, m, g, flops, probes, min_time, max_reps) -> None:
    """The rate of the LM head's bf16 GEMM with fp32 results (kernels/head/bf16_gemm.py) on ``[m, hidden] x [hidden,
    intermediate]`` where it runs: the engine's head takes it where it is faster than fp32 tiles, so the limit
    includes it."""
    from alignopsd.kernels.head.bf16_gemm import gemm_ready, mm_bf16

    if not gemm_ready():
        return
    x = torch.randn(m, hidden, generator=g).bfloat16()
    w = torch.randn(hidden, intermediate, generator=g).bfloat16()
    out = torch.empty(m, intermediate)
    s = _best(lambda: mm_bf16(x, w, out), torch.device("cpu"), min_time, max_reps)
    probes[f"bf16 gemm fp32 out M={m} K={hidden}"] = s
    flops[m] = max(flops.get(m, 0.0), 2.0 * m * hidden * intermediate / s)


def part_seconds(p: Part, lim: DeviceLimits, compute_fraction: float = 1.0, bandwidth_fraction: float = 1.0) -> float:
    """Roofline seconds of one part on ``lim`` (split over ``p.parallel`` such devices)."""
    bw = lim.bytes_per_s * bandwidth_fraction * p.parallel
    if p.decode:
        return max(p.flops / (lim.flops_at(p.rows) * compute_fraction * p.parallel), p.bytes / bw)
    t = p.flops / (lim.flops_at(0) * compute_fraction * p.parallel) if p.flops else 0.0
    return t + p.bytes / bw


def phase_seconds(w: PhaseWork, lim: DeviceLimits, compute_fraction: float = 1.0, bandwidth_fraction: float = 1.0):
    return sum(part_seconds(p, lim, compute_fraction, bandwidth_fraction) for p in w.parts)

"""Phase times predicted from the rates the run's own code reaches on this device (not from a bare GEMM).

The roofline (engine/lab/device_limits.py) is the *limit* a phase's work could reach; on a small CPU model the
phases run far from it for reasons outside the FLOP count (a decoding step pays for sampling over the vocabulary,
per-step bookkeeping and 30 layers of small kernels whatever its row count; the update's backward and fp32 master
weights; the teacher forcing's fp32 attention over kept prompts). :class:`PhaseRates` holds what a short
calibration measured by running the engine's own code paths at the phase's shapes (engine/lab/calibration.py):

- ``prefill_flops``: FLOP/s of the generator's prefill (prompt positions, one logit per row);
- decoding: one step of ``rows`` rows at context ``C`` takes ``step_s + FLOPs(rows, C) / decode_flops`` (a
  least-squares line through probes at several row counts and contexts, :func:`fit_step`): ``step_s`` is what a
  step costs whatever its rows, ``decode_flops`` the rate of the work that grows with rows and context;
- ``score_flops``: the scoring forward (old log-prob, reference): the run's rescorer on one micro-batch of rows;
- ``forcing_flops``: the teacher forcing behind kept prompt keys/values (engine/generation/prompt_cache.py);
- ``train_flops`` and ``optimizer_s``: the update's forward + backward (FLOPs: 3x the forward's, 4x with
  recomputation) through the policy's fused-head loss, and one optimizer step (the supervised warm start's steps
  run the same two: engine/step/supervised.py).

:func:`predict_phases` turns a step's :class:`~alignopsd.engine.lab.cost_model.PhaseWork` (the FLOPs of the same
cost model) into seconds at these rates: the prediction the profiler checks against the measured phases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alignopsd.engine.lab.cost_model import Part, PhaseWork

# decoding steps of a batch over its mean response: the batch decodes until its longest row ends (measured: the
# quickstart's rollout, 4 rows per call, 42-tok mean and 57 max per step; the teacher's 28 rows, 33-tok mean)
STEPS_PER_RESPONSE = 1.3


@dataclass
class PhaseRates:
    device: str
    dtype: str
    threads: int
    prefill_flops: float
    step_s: float
    decode_flops: float
    score_flops: float
    forcing_flops: float
    train_flops: float
    optimizer_s: float
    seconds: float = 0.0  # the calibration's own wall time
    probes: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        g = 1e9
        return (
            f"{self.device}, {self.dtype}, {self.threads} threads (calibrated in {self.seconds:.1f} s on the run's own "
            f"code paths): prefill {self.prefill_flops / g:.0f} GFLOP/s; decoding {1e3 * self.step_s:.0f} ms/step + "
            f"{self.decode_flops / g:.0f} GFLOP/s; scoring {self.score_flops / g:.0f} GFLOP/s; teacher forcing "
            f"{self.forcing_flops / g:.0f} GFLOP/s; update {self.train_flops / g:.0f} GFLOP/s + "
            f"{self.optimizer_s:.2f} s/optimizer step"
        )


def fit_step(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds per step, FLOP/s) of the line ``t = a + flops / rate`` through (step FLOPs, step seconds) points
    (least squares; a negative intercept or slope is clipped: the probes' noise, not a property of the device)."""
    if len(points) < 2:
        raise ValueError(f"fit_step: need >= 2 probe points, got {len(points)}")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # no growth with the work: all of a step is its fixed cost
        return my, float("inf")
    a = my - slope * mx
    if a < 0:  # through the origin instead
        return 0.0, sum(x * x for x, _ in points) / sum(x * y for x, y in points)
    return a, 1.0 / slope


def part_time(p: Part, phase: str, r: PhaseRates) -> float:
    """Seconds of one part of ``phase`` at the calibrated rates."""
    if p.decode:
        return p.steps * r.step_s + p.flops / r.decode_flops
    if p.label == "prefill":
        return p.flops / r.prefill_flops
    if p.label == "forward":
        return p.flops / (r.forcing_flops if phase == "teacher_forcing" else r.score_flops)
    if p.label == "forward+backward":
        return p.flops / r.train_flops
    if p.label == "optimizer":
        return p.steps * r.optimizer_s
    raise ValueError(f"part {p.label!r}: no calibrated rate")


def predict_phases(work: dict[str, PhaseWork], r: PhaseRates) -> dict[str, float]:
    """Predicted seconds per phase of ``work`` (engine/lab/cost_model.step_work) at the rates ``r``."""
    return {k: sum(part_time(p, k, r) for p in w.parts) for k, w in work.items()}

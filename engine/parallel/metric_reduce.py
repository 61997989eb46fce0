"""How each metric reduces over data-parallel ranks: a declared kind per key, and the samples behind percentiles.

Every rank computes its metrics on its share of the step's batch; the logged value must be the one a single
rank holding the whole batch would report. Each key has a kind (:func:`metric_kind`, first matching rule):

    same      the value is the whole batch's already (a config value, a threshold decided over the whole
              batch, the all-reduced gradient norm): rank 0's value
    sum       counts and totals (``*count*``, ``*_total``, token and row numbers, error counters)
    min, max  ``*_min`` / ``*/min``, ``*_max`` / ``*/max``
    quantile  ``*_p<NN>``: recomputed from the values every rank gathered (:class:`Samples`); a percentile no
              rank carried samples for is left out (``metrics/unreduced`` counts them) rather than averaged
    std       ``*_std``: from gathered samples when there are some, else pooled from each rank's mean, std and
              count (exact, up to float rounding)
    rms       a root-mean-square reported as ``_std`` (:data:`RMS_KEYS`): sqrt of the count-weighted mean square
    mean      everything else: the mean of the gathered samples where the family has them, else weighted by the
              key's count: ``<name>_count`` beside ``<name>_mean``, else the count its family declares in
              :data:`FAMILY_WEIGHTS` (turns for m1/ and m2/, episodes for episode/, ...); a family without one
              (actor/ losses, which the update already scales to the global token-mean, summed over ranks /
              world) takes the plain mean over ranks.

Samples: ``{family: (values, ddof)}``, the values behind a family's percentiles and std (:func:`samples_of`, from
what the producers recorded during the step: ``alignopsd.samples``); ``ddof`` is the producer's std convention.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

Samples = dict[str, tuple[list[float], int]]

# whole-batch values: every rank holds the same number
SAME_KEYS = frozenset(
    {
        "actor/lr",
        "actor/kl_coef",
        "actor/grad_norm",
        "m1/teacher_output_budget",
        "m2/segmentation_threshold",
        "m2/segmentation_threshold_available",
        "m2/grpo_normalization_turn",
        "update/fused_head_loss",
        "update/optimizer_steps",
        "update/skipped_optimizer_steps",
        "update/skipped",
        "update/zero_advantage",
    }
)
# root-mean-squares reported under a ``_std`` name, with the count they are taken over: sqrt(weighted mean of squares)
RMS_KEYS = {"m1/teacher_student_gap_std": "m1/corrected_gap_count"}  # RMS of ℓ̃ - ℓ^old over the policy tokens
# the count a family's means are taken over, when the key has no ``<name>_count`` beside it
FAMILY_WEIGHTS: tuple[tuple[str, str], ...] = (
    ("m1/teacher_student_gap_", "m1/corrected_gap_count"),
    ("episode/trajectory_", "episode/unique_trajectory_count"),
    ("episode/outcome_", "episode/unique_trajectory_count"),
    ("m2/trajectory_advantage_", "episode/unique_trajectory_count"),
    ("m2/projection_activation_rate", "episode/unique_trajectory_count"),
    ("m2/segment_budget_entropy_mean", "episode/unique_trajectory_count"),
    ("m2/within_segment_turn_entropy_mean", "m2/segment_count"),
    ("m2/segment_length_", "m2/segment_count"),
    ("episode/", "episode/count"),
    ("rollout/", "batch/rows"),
    ("m1/", "batch/turns"),
    ("m2/", "batch/turns"),
    ("adv/", "batch/turns"),
    ("paired/", "batch/turns"),
    ("regions/", "batch/turns"),
)
_SUM_SUFFIXES = ("_total", "/errors", "/nonfinite_loss", "_tokens_generated", "_tokens_saved", "_forwards")
_QUANTILE = re.compile(r"(.*)_p(\d+)$")


def metric_kind(key: str) -> str:
    """The declared reduction of ``key``: same | sum | min | max | quantile | std | rms | mean (module
    docstring)."""
    if key in RMS_KEYS:
        return "rms"
    if key in SAME_KEYS or key.startswith("time/"):
        return "max" if key.startswith("time/") else "same"  # the slowest rank sets the step's time
    if "count" in key or key.startswith("batch/") or key.endswith(_SUM_SUFFIXES):
        return "sum"
    if key.endswith(("_min", "/min")):
        return "min"
    if key.endswith(("_max", "/max")):
        return "max"
    if _QUANTILE.match(key):
        return "quantile"
    if key.endswith("_std"):
        return "std"
    return "mean"


def _weight_key(key: str, keys: set[str]) -> str | None:
    for suffix in ("_mean", "/mean"):
        if key.endswith(suffix) and key[: -len(suffix)] + "_count" in keys:
            return key[: -len(suffix)] + "_count"
    return next((w for prefix, w in FAMILY_WEIGHTS if key.startswith(prefix)), None)


def _quantile(values: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (the definition of ``torch.quantile`` and ``numpy.quantile``)."""
    v = torch.sort(values).values
    pos = q * (v.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def _pooled_std(key: str, gathered: Sequence[dict], weight: str | None) -> float | None:
    """std of the union from each rank's (count, mean, std); None when a piece is missing."""
    name = key[: -len("_std")]
    count_key = name + "_count" if any(name + "_count" in g for g in gathered) else weight
    ddof = 1 if count_key == name + "_count" else 0  # describe() counts and uses ddof 1; Metrics.dist ddof 0
    parts = []
    for g in gathered:
        if g.get(key) is None:
            continue
        n, mu = g.get(count_key) if count_key else None, g.get(name + "_mean")
        if n is None or mu is None:
            return None
        parts.append((float(n), float(mu), float(g[key])))
    total = sum(n for n, _, _ in parts)
    if total - ddof <= 0:
        return 0.0
    mean = sum(n * mu for n, mu, _ in parts) / total
    ss = sum((n - ddof) * s * s + n * (mu - mean) ** 2 for n, mu, s in parts if n > 0)
    return math.sqrt(max(ss, 0.0) / (total - ddof))


def _from_samples(key: str, kind: str, samples: Samples) -> float | None:
    m = _QUANTILE.match(key)
    name = m.group(1) if kind == "quantile" and m else key.rsplit("_", 1)[0]
    if name not in samples:
        return None
    values, ddof = samples[name]
    v = torch.tensor(values, dtype=torch.float64)
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return 0.0
    if kind == "quantile":
        return _quantile(v, int(m.group(2)) / 100.0)
    return float(v.std(correction=ddof)) if v.numel() > ddof else 0.0


def samples_of(metrics: dict[str, float], records: Sequence[tuple[str, Any, int]]) -> Samples:
    """This rank's samples for its percentile and std metrics, from the distributions the producers recorded
    (``alignopsd.samples.recording_samples``). A family ``<prefix><name>`` takes the recorded ``name`` (a full
    prefix from ``Metrics``, a bare name from ``describe``) whose values reproduce the family's reported mean (or
    median): several producers describe distributions of one bare name under different prefixes."""
    families = {_family(k) for k in metrics if metric_kind(k) in ("quantile", "std")}
    by_name: dict[str, list[tuple[Any, int]]] = {}
    for name, values, ddof in records:
        by_name.setdefault(name, []).append((values, ddof))
    out: Samples = {}
    for fam in sorted(families):
        cands = by_name.get(fam, []) + [c for n, cs in by_name.items() if fam.endswith("/" + n) for c in cs]
        for values, ddof in cands:
            v = torch.as_tensor(values).detach().reshape(-1).to("cpu", torch.float64)
            v = v[torch.isfinite(v)]
            if _reproduces(v, fam, metrics):
                out[fam] = (v.tolist(), ddof)
                break
    return out


def _family(key: str) -> str:
    m = _QUANTILE.match(key)
    return m.group(1) if m else key[: -len("_std")]


def _reproduces(v: torch.Tensor, fam: str, metrics: dict[str, float]) -> bool:
    """Whether ``v`` is the distribution behind ``fam``'s reported statistics."""
    for stat, fn in (("_count", lambda x: float(x.numel())), ("_mean", lambda x: float(x.mean())),
                     ("_p50", lambda x: _quantile(x, 0.5)), ("_p95", lambda x: _quantile(x, 0.95))):  # fmt: skip
        want = metrics.get(fam + stat)
        if want is None:
            continue
        if v.numel() == 0:
            return want == 0.0
        if not math.isclose(fn(v), want, rel_tol=1e-9, abs_tol=1e-12):
            return False
    return any(fam + stat in metrics for stat in ("_count", "_mean", "_p50", "_p95"))


def merge_samples(per_rank: Sequence[Samples | None]) -> Samples:
    """The ranks' samples concatenated in rank order (one multiset per name)."""
    out: Samples = {}
    for s in per_rank:
        for name, (values, ddof) in (s or {}).items():
            have = out.setdefault(name, ([], ddof))
            have[0].extend(float(x) for x in values)
    return out


def reduce_over_ranks(gathered: Sequence[dict[str, float]], samples: Samples | None = None) -> dict[str, float]:
    """One metric dict from the contributing ranks' dicts by each key's declared kind (see the module
    docstring); keys a rank lacks (or holds as None) are reduced over the ranks that have them."""
    samples = samples or {}
    keys = {k for g in gathered for k in g}
    out: dict[str, float] = {}
    unreduced = 0
    for k in sorted(keys):
        vals = [(g, float(g[k])) for g in gathered if g.get(k) is not None]
        if not vals:
            continue
        kind = metric_kind(k)
        if kind in ("quantile", "std") and len(vals) > 1:
            got = _from_samples(k, kind, samples)
            if got is None and kind == "std":
                got = _pooled_std(k, [g for g, _ in vals], _weight_key(k[: -len("_std")] + "_mean", keys))
            if got is None:
                unreduced += 1
                continue
            out[k] = got
        elif kind == "rms" and len(vals) > 1:
            out[k] = math.sqrt(max(_weighted_mean([(g, v * v) for g, v in vals], RMS_KEYS[k]), 0.0))
        elif kind == "same" or len(vals) == 1:
            out[k] = vals[0][1]
        elif kind == "sum":
            out[k] = sum(v for _, v in vals)
        elif kind in ("min", "max"):
            out[k] = (min if kind == "min" else max)(v for _, v in vals)
        elif k.endswith("_mean") and k[: -len("_mean")] in samples:  # the values themselves: no weight needed
            got = torch.tensor(samples[k[: -len("_mean")]][0], dtype=torch.float64)
            got = got[torch.isfinite(got)]
            out[k] = float(got.mean()) if got.numel() else 0.0
        else:
            out[k] = _weighted_mean(vals, _weight_key(k, keys))
    if unreduced:
        out["metrics/unreduced"] = float(unreduced)
    return out


def _weighted_mean(vals: list[tuple[dict, float]], weight: str | None) -> float:
    ws = [g.get(weight) for g, _ in vals] if weight else [None]
    if weight is None or any(w is None for w in ws):
        return sum(v for _, v in vals) / len(vals)
    total = sum(float(w) for w in ws)
    if total <= 0:
        return sum(v for _, v in vals) / len(vals)
    return sum(float(w) * v for w, (_, v) in zip(ws, vals)) / total
